"""FP8 modules of an HF model: linears and MoE experts whose weights stay FP8 with block scales.

An FP8 checkpoint (models/fp8_format.py) is loaded into the HF model with its quantized modules
replaced here, on the meta device, before any weight exists:

- every `nn.Linear` whose checkpoint weight is FP8 becomes an `FP8Linear`: parameters `weight`
  (float8_e4m3fn [N, K]), `weight_scale_inv` (float32 block grid) and `bias` (if any) under the
  checkpoint's own names; its forward calls `torch.ops.autodeploy.fp8_block_linear`, so the
  exported graph holds that source op and the passes see it;
- every transformers experts module (3-D `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) whose
  per-expert checkpoint tensors are FP8 keeps those two parameters in FP8 and gains
  `gate_up_proj_scale_inv [E, 2I/bn, ceil(H/bk)]`, `down_proj_scale_inv [E, ceil(H/bn), ceil(I/bk)]`.
  Its forward dequantizes them (`fp8_block_dequantize`) and runs transformers' own experts forward
  on the result: a graph `fuse_moe` recognises and turns into an FP8 MoE op, and that is exact
  (the reference) where none is available.

Which modules are FP8 is decided by the tensors, not by names: a checkpoint weight is FP8 when it
is stored as float8_e4m3fn (its scale must then be there). For random weights (`model.init:
hashed` with a `quantization_config`), every linear except the output embedding and the config's
`modules_to_not_convert`, and every experts module, is FP8 — the published layout.

Nothing here materialises a 16-bit copy of an FP8 weight: the dequantized experts exist only for
the duration of a reference forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from .fp8_format import FP8_DTYPE, BlockFP8Format, FP8FormatError, scale_shape

SCALE_SUFFIX = "_scale_inv"
#: Parameter names of transformers' fused experts modules (is_concatenated, not transposed).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _fp8_op(name: str) -> Any:
    try:
        return getattr(torch.ops.autodeploy, name)
    except AttributeError:
        raise RuntimeError(f"torch.ops.autodeploy.{name} is not registered: import autodeploy_mla.custom_ops "
                           "before running an FP8 model") from None


def _meta_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


class FP8Linear(nn.Module):
    """A linear with an FP8 weight and its block scales (module doc); forward = the source op."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: BlockFP8Format,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_n, self.block_k = fmt.block
        self.weight = _meta_param((out_features, in_features), FP8_DTYPE)
        self.weight_scale_inv = _meta_param(scale_shape(out_features, in_features, fmt), torch.float32)
        self.bias = _meta_param((out_features,), bias_dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_op("fp8_block_linear")(x, self.weight, self.weight_scale_inv, self.bias, self.block_n,
                                           self.block_k)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block=[{self.block_n}, {self.block_k}]")


class _DequantizedExperts:
    """The experts module as transformers' forward sees it, with 16-bit `gate_up_proj` / `down_proj`."""

    def __init__(self, module: nn.Module, **weights: torch.Tensor) -> None:
        self.__dict__["_module"] = module
        self.__dict__.update(weights)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def _fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    dq = _fp8_op("fp8_block_dequantize")
    bn, bk = self.fp8_block
    weights = {p: dq(getattr(self, p), getattr(self, p + SCALE_SUFFIX), bn, bk, hidden_states.dtype)
               for p in EXPERT_PARAMS}
    return type(self).forward(_DequantizedExperts(self, **weights), hidden_states, *args, **kwargs)


def is_experts_module(module: nn.Module) -> bool:
    """transformers' fused experts: 3-D `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` parameters."""
    ps = module._parameters
    if not all(isinstance(ps.get(p), torch.Tensor) and ps[p].dim() == 3 for p in EXPERT_PARAMS):
        return False
    gu, d = ps["gate_up_proj"], ps["down_proj"]
    return gu.shape[0] == d.shape[0] and gu.shape[1] == 2 * d.shape[2] and gu.shape[2] == d.shape[1]


def make_fp8_experts(module: nn.Module, fmt: BlockFP8Format, name: str) -> None:
    """Turn a (meta) experts module into FP8 experts in place (module doc)."""
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise FP8FormatError(f"{name}: FP8 experts need the [E, out, in] concatenated [gate; up] layout; this "
                             "module stores them transposed or interleaved")
    e, two_i, h = module.gate_up_proj.shape
    i = two_i // 2
    if i % fmt.block_n:
        raise FP8FormatError(
            f"{name}: expert intermediate size {i} is not a multiple of block_n {fmt.block_n}: the gate and up "
            "halves' scale blocks would not stack into one [gate; up] grid. Expected a checkpoint whose "
            "moe_intermediate_size is a multiple of weight_block_size[0] (every published model's is)")
    for p in EXPERT_PARAMS:
        shape = tuple(module._parameters[p].shape)
        module._parameters[p] = _meta_param(shape, FP8_DTYPE)
        module._parameters[p + SCALE_SUFFIX] = _meta_param((e, *scale_shape(shape[1], shape[2], fmt)), torch.float32)
    module.fp8_block = fmt.block
    module.forward = _fp8_experts_forward.__get__(module)  # instance-level: the class stays transformers'


def _excluded(name: str, fmt: BlockFP8Format) -> bool:
    return any(name == m or name.startswith(m + ".") or name.endswith("." + m) for m in fmt.modules_to_not_convert)


def convert_to_fp8(model: nn.Module, fmt: BlockFP8Format,
                   is_fp8: Optional[Callable[[str, nn.Module], bool]] = None) -> list[str]:
    """Replace the quantized modules of a meta-device HF model (module doc). `is_fp8(name, module)`
    decides per linear / experts module (default: the published layout, for random weights).
    Returns the converted module names."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def default(name: str, mod: nn.Module) -> bool:
        return mod is not out_emb and not _excluded(name, fmt)

    decide = is_fp8 or default
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and decide(name, mod):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            bias = mod.bias
            new = FP8Linear(mod.in_features, mod.out_features, bias is not None, fmt,
                            bias.dtype if bias is not None else torch.float32)
            setattr(parent, attr, new)
            done.append(name)
        elif is_experts_module(mod) and decide(name, mod):
            make_fp8_experts(mod, fmt, name)
            done.append(name)
    return done


def fp8_param_names(model: nn.Module) -> dict[str, str]:
    """FP8 weight parameter name -> its scale's name, for every FP8 module of `model`."""
    out = {}
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, FP8Linear):
            out[prefix + "weight"] = prefix + "weight_scale_inv"
        elif getattr(mod, "fp8_block", None) is not None:
            for p in EXPERT_PARAMS:
                out[prefix + p] = prefix + p + SCALE_SUFFIX
    return out


def block_of(model: nn.Module, param: str) -> Optional[tuple[int, int]]:
    """(block_n, block_k) of FP8 parameter `param` of `model` (None: not FP8)."""
    mod_name, _, attr = param.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(mod, FP8Linear) and attr in ("weight", "weight_scale_inv"):
        return (mod.block_n, mod.block_k)
    block = getattr(mod, "fp8_block", None)
    return block if block is not None and attr.removesuffix(SCALE_SUFFIX) in EXPERT_PARAMS else None


def model_fp8_format(config: Any, where: str = "config.json") -> Optional[BlockFP8Format]:
    """The FP8 format an HF config's `quantization_config` declares (None: the model is not
    quantized); FP8FormatError for a quantization this project does not load."""
    qc = getattr(config, "quantization_config", None)
    if qc is None and isinstance(config, dict):
        qc = config.get("quantization_config")
    if not qc:
        return None
    return BlockFP8Format.from_quantization_config(qc, where)


def hashed_fp8_tensor(make: Callable[..., torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device, sel: Any, block: tuple[int, int], std: float) -> torch.Tensor:
    """Part `sel` of FP8 parameter `name` (weight or its scale) of hashed random init, generated at
    that size alone: the scale of every block is std*sqrt(3)/448 (the hashed values' range maps onto
    the e4m3 range), the weight the hashed value over that scale, rounded to FP8. `make(name, shape,
    dtype, device, sel)`: HashedInit.tensor. Chunked over the leading dim (no full fp32 copy)."""
    scale = std * math.sqrt(3.0) / 448.0
    sel = tuple(sel) if sel is not None else (None,) * len(shape)
    if name.endswith(SCALE_SUFFIX):
        out_shape = [sum(b - a for a, b in r) if r is not None else n for n, r in zip(shape, sel)]
        return torch.full(out_shape, scale, dtype=torch.float32, device=device)
    ranges0 = sel[0] if sel[0] is not None else ((0, shape[0]),)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, (1 << 24) // max(1, row))
    parts = []
    for a, b in ranges0:
        for s in range(a, b, step):
            chunk = make(name, shape, torch.float32, device, (((s, min(b, s + step)),), *sel[1:]))
            parts.append((chunk / scale).clamp(-448.0, 448.0).to(dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


__all__ = ["EXPERT_PARAMS", "SCALE_SUFFIX", "FP8Linear", "block_of", "convert_to_fp8", "fp8_param_names",
           "hashed_fp8_tensor", "is_experts_module", "make_fp8_experts", "model_fp8_format"]
