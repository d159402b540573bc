"""The block-scaled FP8 weight format of published checkpoints, and its reference math.

DeepSeek-V3 / R1 / V3.2 and Kimi-K2 store every decoder linear as `float8_e4m3fn [N, K]` with a
float32 `weight_scale_inv [ceil(N/bn), ceil(K/bk)]`: the real weight is the FP8 value times the
scale of its (bn x bk) block; the last block row / column is partial when N or K is not a
multiple of the block. `config.json` says so in `quantization_config` (`quant_method: fp8`,
`fmt: e4m3`, `activation_scheme: dynamic`, `weight_block_size: [128, 128]`).

Some FP8 checkpoints (Mistral's, transformers' FineGrainedFP8 without a block size) store one
scale per tensor instead (`weight_block_size: null`, usually `activation_scheme: static` with a
per-tensor activation scale). A per-tensor scale is a block grid whose blocks all hold the same
value, so the loader turns it into that grid (blocks of `TENSOR_SCALE_BLOCK`) and everything
downstream sees one format. The static activation scale is not used: activations are quantized
per token and column group on the fly, as for dynamic checkpoints (a finer grid than one scale
for the whole tensor; docs/fp8_weights.md).

This module lives in `models` because the loader needs it; `custom_ops/fp8/format.py` re-exports
it under the name the kernels use. Pure torch, no kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .errors import ModelLoadError

#: The FP8 dtype of the weights (`fmt: e4m3`) and its largest finite value.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: quant_method values this project loads.
QUANT_METHODS = ("fp8",)
#: Block sizes accepted per dim: powers of two in [16, 1024]. A whole number of blocks then fits
#: any Triton tile (tl.dot takes K tiles of 16 and up, powers of two), and the torch reference
#: serves every one of them; which backend serves a given block size is decided per node.
MIN_BLOCK, MAX_BLOCK = 16, 1024
#: The block grid a per-tensor scale is expanded to (the kernels' native block).
TENSOR_SCALE_BLOCK = (128, 128)


class FP8FormatError(ModelLoadError, ValueError):
    """A quantization_config or an FP8 tensor does not fit the supported format; the message names
    the value or tensor, what was expected and what to do."""


def _block_ok(b: Any) -> bool:
    return isinstance(b, int) and not isinstance(b, bool) and MIN_BLOCK <= b <= MAX_BLOCK and b & (b - 1) == 0


@dataclass(frozen=True)
class BlockFP8Format:
    """How a checkpoint's FP8 weights are scaled: blocks of `block_n` output rows x `block_k` input
    columns share one float32 scale (`weight_scale_inv`: real = fp8 * scale).

    `per_tensor`: the checkpoint stores one scale per tensor (expanded to the block grid on load).
    `activation_scheme`: what the checkpoint says; activations are always quantized dynamically.
    `modules_to_not_convert`: module names the config leaves in 16-bit (informational for
    checkpoints, where the tensors decide; used by hashed FP8 init)."""

    block_n: int = 128
    block_k: int = 128
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    per_tensor: bool = False
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for what, b in (("block_n", self.block_n), ("block_k", self.block_k)):
            if not _block_ok(b):
                raise FP8FormatError(
                    f"FP8 {what} {b!r}: expected a power of two in [{MIN_BLOCK}, {MAX_BLOCK}] (DeepSeek-V3 uses "
                    "128); the kernels tile whole blocks. Re-quantize the checkpoint with a supported "
                    "weight_block_size.")

    @property
    def block(self) -> tuple[int, int]:
        return (self.block_n, self.block_k)

    @staticmethod
    def from_quantization_config(qc: Union[Mapping[str, Any], Any], where: str = "config.json") -> "BlockFP8Format":
        """Parse and validate an HF `quantization_config` (dict or transformers config object)."""
        if not isinstance(qc, Mapping):
            to_dict = getattr(qc, "to_dict", None)
            qc = to_dict() if callable(to_dict) else dict(vars(qc))
        method = qc.get("quant_method")
        method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
        if method not in QUANT_METHODS:
            raise FP8FormatError(
                f"{where}: quantization_config.quant_method {method!r} is not supported; supported: "
                f"{', '.join(QUANT_METHODS)} (block- or tensor-scaled float8_e4m3fn weights). Use a 16-bit or an "
                "FP8 checkpoint of the model.")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise FP8FormatError(f"{where}: quantization_config.fmt {fmt!r} is not supported; expected e4m3 "
                                 "(float8_e4m3fn weights)")
        scale_fmt = qc.get("scale_fmt") or "float"
        if scale_fmt != "float":
            raise FP8FormatError(f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not supported; expected "
                                 "float (float32 weight_scale_inv)")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        block = qc.get("weight_block_size")
        per_tensor = block is None
        if scheme not in ("dynamic", "static"):
            raise FP8FormatError(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported; "
                                 "expected dynamic (activations quantized per token and column block on the fly)")
        if scheme == "static" and not per_tensor:
            raise FP8FormatError(
                f"{where}: quantization_config.activation_scheme 'static' with weight_block_size {block}: static "
                "activation scales with block-scaled weights are not supported; expected activation_scheme dynamic "
                "(DeepSeek-V3's format) or per-tensor weights (weight_block_size null)")
        if per_tensor:
            bn, bk = TENSOR_SCALE_BLOCK
        else:
            if not isinstance(block, (list, tuple)) or len(block) != 2:
                raise FP8FormatError(f"{where}: quantization_config.weight_block_size {block!r}: expected two "
                                     "integers [block_n, block_k], e.g. [128, 128]")
            bn, bk = block
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        try:
            return BlockFP8Format(bn, bk, "e4m3", scheme, per_tensor, tuple(str(s) for s in skip))
        except FP8FormatError as exc:
            raise FP8FormatError(f"{where}: quantization_config.weight_block_size {block}: {exc}") from None

    def to_quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` of a checkpoint in this format (what tests write)."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": self.fmt, "activation_scheme": self.activation_scheme,
                               "weight_block_size": None if self.per_tensor else [self.block_n, self.block_k]}
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out


Block = Union[BlockFP8Format, tuple[int, int]]


def _bnk(fmt: Block) -> tuple[int, int]:
    return fmt.block if isinstance(fmt, BlockFP8Format) else (int(fmt[0]), int(fmt[1]))


def scale_shape(n: int, k: int, fmt: Block) -> tuple[int, int]:
    """Shape of the `weight_scale_inv` of an [n, k] weight: one per (possibly partial) block."""
    bn, bk = _bnk(fmt)
    return (math.ceil(n / bn), math.ceil(k / bk))


def check_scale(name: str, weight_shape: tuple[int, ...], scale: torch.Tensor, fmt: Block) -> None:
    """FP8FormatError unless `scale` is the float32 block grid of a weight of `weight_shape`
    (leading dims, e.g. experts, shared)."""
    want = (*weight_shape[:-2], *scale_shape(weight_shape[-2], weight_shape[-1], fmt))
    if tuple(scale.shape) != want:
        raise FP8FormatError(
            f"{name}: shape {list(scale.shape)}, expected {list(want)} = ceil({list(weight_shape[-2:])} / block "
            f"{list(_bnk(fmt))}) for its weight {list(weight_shape)}; the checkpoint's weight_block_size does not "
            "match its scales")
    if scale.dtype != torch.float32:
        raise FP8FormatError(f"{name}: dtype {scale.dtype}, expected torch.float32")


def expand_scale(scale_inv: torch.Tensor, n: int, k: int, fmt: Block) -> torch.Tensor:
    """The per-element scale [..., n, k] of a block grid [..., ceil(n/bn), ceil(k/bk)]."""
    bn, bk = _bnk(fmt)
    return scale_inv.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Block,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight (`dtype`) of an FP8 weight [..., N, K] and its block scales: fp8 value times
    the scale of its block, computed in float32 and rounded once to `dtype`. The reference that
    every kernel and the HF comparison agree with."""
    n, k = weight.shape[-2:]
    return (weight.to(torch.float32) * expand_scale(scale_inv.to(torch.float32), n, k, fmt)).to(dtype)


def quantize_weight(w: torch.Tensor, fmt: Block, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) of a real weight [..., N, K]: each block scaled so its
    largest magnitude maps to 448 (scale_inv = amax / 448). For writing test checkpoints and
    hashed FP8 init; `dequantize` of the result is the weight to within FP8 rounding."""
    n, k = w.shape[-2:]
    bn, bk = _bnk(fmt)
    nb, kb = scale_shape(n, k, (bn, bk))
    wf = w.to(torch.float32)
    pad = torch.zeros((*w.shape[:-2], nb * bn, kb * bk), dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = wf
    blocks = pad.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.clamp(amax, min=eps) / FP8_MAX
    q = (wf / expand_scale(scale, n, k, (bn, bk))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_weight_bytes(n: int, k: int, fmt: Block, leading: int = 1) -> int:
    """Bytes of an FP8 weight [leading x n x k] with its scales."""
    nb, kb = scale_shape(n, k, fmt)
    return leading * (n * k + 4 * nb * kb)


def hashed_scale(n: int, k: int, fmt: Block, std: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """The block scale grid of hashed FP8 init: every block std * sqrt(3) / 448 (HashedInit draws
    uniform values of that range; their FP8 codes are spread over the whole e4m3 range)."""
    return torch.full(scale_shape(n, k, fmt), std * math.sqrt(3.0) / FP8_MAX, dtype=torch.float32, device=device)


__all__ = ["FP8_DTYPE", "FP8_MAX", "MAX_BLOCK", "MIN_BLOCK", "QUANT_METHODS", "TENSOR_SCALE_BLOCK", "BlockFP8Format",
           "FP8FormatError", "check_scale", "dequantize", "expand_scale", "fp8_weight_bytes", "hashed_scale",
           "quantize_weight", "scale_shape"]
