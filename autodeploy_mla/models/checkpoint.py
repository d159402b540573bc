"""Reading a safetensors checkpoint by slices, and filling a module's weights from it.

`CheckpointReader` opens a checkpoint directory (single file or index + shards) and reads any
slice of a tensor without loading the rest. Checkpoint layouts that differ from the module's
parameters are described as virtual tensors: transformers' fused MoE expert weights
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) are stacks/concatenations of the
per-expert `experts.{e}.gate_proj/up_proj/down_proj.weight` tensors that HF checkpoints hold; a
slice of the fused weight reads only the matching rows of each expert tensor.

`ShardSpec` says which part of a weight one tensor-parallel rank keeps; `load_graph_weights` fills
a (skeleton's) graph from the checkpoint, reading only those parts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .factory import ModelLoadError
from .fp8_format import FP8_DTYPE, FP8FormatError
from .fp8_modules import SCALE_SUFFIX, block_of, hashed_fp8_tensor
from .safetensors_io import CheckpointReader
from .random_init import HashedInit
from .skeleton import is_placeholder, placeholder, skeleton_info

Range = tuple[int, int]
Selection = tuple[Optional[tuple[Range, ...]], ...]  # per dim: None (all) or index ranges, concatenated


# Virtual tensors: how one module parameter is assembled from checkpoint tensors.
@dataclass
class Ckpt:
    key: str
    shape: tuple[int, ...]


@dataclass
class Stack:  # new leading dim
    parts: list[Any]
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.shape = (len(self.parts), *self.parts[0].shape)


@dataclass
class Concat:
    parts: list[Any]
    dim: int
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        s = list(self.parts[0].shape)
        s[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        self.shape = tuple(s)


@dataclass
class Transposed:  # 2-D transpose
    part: Any
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.shape = tuple(reversed(self.part.shape))


@dataclass
class Filled:  # one stored value (a per-tensor FP8 scale) standing for a whole grid of `shape`
    key: str
    shape: tuple[int, ...]


Source = Union[Ckpt, Stack, Concat, Transposed, Filled]


def read_source(reader: CheckpointReader, src: Source, sel: Selection) -> torch.Tensor:
    """The selected part of a virtual tensor (`sel`: per dim None or ranges, concatenated)."""
    if isinstance(src, Ckpt):
        dims = [d for d, r in enumerate(sel) if r is not None]
        if len(dims) > 1:
            raise ValueError(f"{src.key}: selections on more than one dim are not supported")
        if not dims:
            return reader.read(src.key, ())
        d = dims[0]
        ranges: tuple[Range, ...] = sel[d]  # type: ignore[assignment]
        pieces = [reader.read(src.key, tuple([slice(None)] * d + [slice(a, b)])) for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    if isinstance(src, Filled):
        value = reader.read(src.key, ()).reshape(())
        out = [sum(b - a for a, b in r) if r is not None else n for n, r in zip(src.shape, sel)]
        return value.expand(out).contiguous()
    if isinstance(src, Stack):
        ranges = sel[0] if sel[0] is not None else ((0, len(src.parts)),)
        idx = [i for a, b in ranges for i in range(a, b)]
        return torch.stack([read_source(reader, src.parts[i], sel[1:]) for i in idx])
    if isinstance(src, Transposed):
        return read_source(reader, src.part, (sel[1], sel[0])).t()
    # Concat
    d = src.dim
    ranges = sel[d] if sel[d] is not None else ((0, src.shape[d]),)
    out = []
    for a, b in ranges:
        off = 0
        for part in src.parts:
            n = part.shape[d]
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                sub = list(sel)
                sub[d] = ((lo - off, hi - off),)
                out.append(read_source(reader, part, tuple(sub)))
            off += n
    return out[0] if len(out) == 1 else torch.cat(out, d)


_FUSED_EXPERTS = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)(_scale_inv)?")
#: names a per-tensor FP8 scale is stored under: transformers' FineGrainedFP8 and compressed-tensors style
_TENSOR_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def _scale_source(reader: CheckpointReader, weight_key: str, want: tuple[int, ...]) -> Source:
    """The block-scale grid `want` of FP8 checkpoint weight `weight_key`: its `weight_scale_inv`, or a
    per-tensor scale (one stored value) filled over the grid. FP8FormatError when missing or misshapen."""
    base = weight_key.removesuffix(".weight")
    for attr in _TENSOR_SCALE_NAMES:
        key = f"{base}.{attr}"
        if not reader.has(key):
            continue
        got = reader.shape(key)
        if got == want:
            if attr != "weight_scale_inv":
                break  # a full grid under the per-tensor name: not a format we know
            if reader.dtype(key) != "F32":
                raise FP8FormatError(f"checkpoint tensor {key}: dtype {reader.dtype(key)}, expected F32 (float32 "
                                     "block scales)")
            return Ckpt(key, got)
        if int(torch.Size(got).numel()) == 1:
            return Filled(key, want)
        raise FP8FormatError(
            f"checkpoint tensor {key} has shape {list(got)}, expected {list(want)} (one float32 scale per block of its "
            f"FP8 weight {weight_key} {list(reader.shape(weight_key))}) or a single per-tensor scale; the "
            "checkpoint's scales do not match config.json's weight_block_size")
    raise FP8FormatError(
        f"checkpoint weight {weight_key} is float8_e4m3fn but its scale {base}.weight_scale_inv is missing "
        f"(expected float32 {list(want)}); the checkpoint is incomplete: re-download or re-convert it")


def _weight_source(reader: CheckpointReader, key: str, fp8: bool) -> Ckpt:
    is_fp8 = reader.dtype(key) == "F8_E4M3"
    if is_fp8 and not fp8:
        raise FP8FormatError(f"checkpoint tensor {key} is float8_e4m3fn, but the model takes it in 16 bits: FP8 "
                             "weights load only into FP8 linears / experts (an FP8 checkpoint needs a "
                             "quantization_config in config.json)")
    if fp8 and not is_fp8:
        raise FP8FormatError(f"checkpoint tensor {key} is {reader.dtype(key)}, but its module is FP8 (expected "
                             "F8_E4M3 like the checkpoint's other quantized weights)")
    return Ckpt(key, reader.shape(key))


def source_for(reader: CheckpointReader, name: str, shape: tuple[int, ...],
               dtype: Optional[torch.dtype] = None, block: Optional[tuple[int, int]] = None) -> Source:
    """The virtual tensor that holds module parameter/buffer `name` of `shape` in the checkpoint.
    `dtype` and `block`: the parameter's dtype and, for FP8 weights and their scales, the block size
    (scales are checked against it; per-tensor scales are filled over the grid)."""
    fp8 = dtype == FP8_DTYPE
    is_scale = name.endswith(SCALE_SUFFIX)
    if is_scale and reader.has(name.removesuffix(SCALE_SUFFIX)):  # weight_scale_inv of an FP8 linear
        return _scale_source(reader, name.removesuffix(SCALE_SUFFIX), shape)
    if reader.has(name):
        got = reader.shape(name)
        if got != shape:
            raise ModelLoadError(f"checkpoint tensor {name} has shape {list(got)}, the model expects {list(shape)}")
        if reader.dtype(name).startswith("F8") or fp8:
            return _weight_source(reader, name, fp8)
        return Ckpt(name, got)
    m = _FUSED_EXPERTS.fullmatch(name)
    if m is not None and len(shape) == 3:
        base, fused_gate_up, scale = m.group(1), m.group(2) == "gate_up_proj", m.group(3) is not None
        names = ("gate_proj", "up_proj") if fused_gate_up else ("down_proj",)
        experts = []
        keys: list[str] = []
        for e in range(shape[0]):
            keys = [f"{base}.experts.{e}.{n}.weight" for n in names]
            if not all(reader.has(k) for k in keys):
                break
            if scale:
                if block is None:
                    raise ModelLoadError(f"{name}: an FP8 scale without its block size")
                grids = []
                for k in keys:
                    n_rows, k_cols = reader.shape(k)
                    grids.append(_scale_source(reader, k, (-(-n_rows // block[0]), -(-k_cols // block[1]))))
                experts.append(grids)
            else:
                experts.append([_weight_source(reader, k, fp8) if (fp8 or reader.dtype(k).startswith("F8"))
                                else Ckpt(k, reader.shape(k)) for k in keys])
        if len(experts) == shape[0]:
            out_rows = sum(p.shape[0] for p in experts[0])
            in_cols = experts[0][0].shape[1]
            if shape[1:] == (out_rows, in_cols):  # [E, out, in]
                return Stack([p[0] if len(p) == 1 else Concat(p, 0) for p in experts])
            if shape[1:] == (in_cols, out_rows) and not scale:  # [E, in, out]
                return Stack([Transposed(p[0]) if len(p) == 1 else Transposed(Concat(p, 0)) for p in experts])
            raise ModelLoadError(
                f"{name}: model shape {list(shape)} matches neither [E, out, in] nor [E, in, out] of the "
                f"per-expert checkpoint tensors ({keys[0]}{'_scale_inv' if scale else ''}: "
                f"{list(experts[0][0].shape)})"
            )
    if is_scale:
        raise FP8FormatError(f"model FP8 scale {name} {list(shape)}: its weight {name.removesuffix(SCALE_SUFFIX)} is "
                             f"not in the checkpoint {reader.path}")
    near = [k for k in reader.weight_map if k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0]][:5]
    raise ModelLoadError(
        f"model weight {name} {list(shape)} is not in the checkpoint {reader.path} (nor as per-expert "
        f"tensors of a fused MoE weight){'; tensors of that module: ' + ', '.join(near) if near else ''}. "
        "Set transforms.shard.load=full to let transformers load (and convert) the whole checkpoint."
    )


# ----------------------------------------------------------------------------- filling a graph
@dataclass(frozen=True)
class ShardSpec:
    """This rank's part of one weight: `ranges` of `dim`, concatenated (e.g. the gate and the up
    halves of a fused gate_up weight). `zero`: this rank holds zeros (the bias of a row-parallel
    matmul is added by rank 0 only, so the all-reduce adds it exactly once)."""

    dim: int
    ranges: tuple[Range, ...]
    rule: str
    zero: bool = False

    def selection(self, ndim: int) -> Selection:
        return tuple(self.ranges if d == self.dim else None for d in range(ndim))

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        s = list(full)
        s[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(s)

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of `t`; a placeholder of the sliced shape when `t` is one (skeletons)."""
        if is_placeholder(t):
            return placeholder(self.shape(t.shape), t.dtype, t.device, base=t)
        if self.zero:
            return torch.zeros(self.shape(t.shape), dtype=t.dtype, device=t.device)
        parts = [t.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)).contiguous()


def set_module_tensor(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Replace the parameter/buffer/attribute at dotted path `target` (a graph's get_attr nodes see the new one)."""
    mod_path, _, attr = target.rpartition(".")
    mod = root.get_submodule(mod_path) if mod_path else root
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = value
    else:
        setattr(mod, attr, value)


def module_tensor(root: nn.Module, target: str) -> Any:
    """The attribute at dotted path `target` of `root` (parameter, buffer or plain attribute)."""
    mod_path, _, attr = target.rpartition(".")
    mod = root.get_submodule(mod_path) if mod_path else root
    return getattr(mod, attr)


def model_name(target: str, names: Union[set[str], frozenset[str]]) -> Optional[str]:
    """The model's own name for a graph attribute (the export wrapper adds a `model.` prefix)."""
    for cand in (target, target.removeprefix("model.")):
        if cand in names:
            return cand
    return None


class _CheckpointWeights:
    """Weights by name and selection, read from the skeleton's checkpoint."""

    def __init__(self, path: Path) -> None:
        self.reader = CheckpointReader(path)

    def get(self, candidates: Sequence[str], full: tuple[int, ...], sel: Selection, is_param: bool,
            dtype: torch.dtype, device: torch.device, block: Optional[tuple[int, int]] = None
            ) -> Optional[torch.Tensor]:
        src = None
        for cand in candidates:
            try:
                src = source_for(self.reader, cand, full, dtype, block)
                break
            except ModelLoadError:
                if cand == candidates[-1] and is_param:
                    raise
        if src is None:  # a persistent buffer the checkpoint lacks: keep its constructed value
            return None
        return read_source(self.reader, src, sel)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def close(self) -> None:
        self.reader.close()


class _HashedWeights:
    """Weights by name and selection, generated on the device (models/random_init.py)."""

    def __init__(self, init: HashedInit) -> None:
        self.init = init
        self.bytes_read = 0

    def get(self, candidates: Sequence[str], full: tuple[int, ...], sel: Selection, is_param: bool,
            dtype: torch.dtype, device: torch.device, block: Optional[tuple[int, int]] = None
            ) -> Optional[torch.Tensor]:
        if not is_param:  # buffers are real in a skeleton: keep their constructed value
            return None
        if block is not None:  # an FP8 weight or its scales, made at this selection's size alone
            t = hashed_fp8_tensor(self.init.tensor, candidates[0], full, dtype, device, sel, block, self.init.std)
        else:
            t = self.init.tensor(candidates[0], full, dtype, device, sel)  # a tied weight's first name
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        pass


def load_graph_weights(
    gm: nn.Module, model: nn.Module, specs: dict[str, ShardSpec], device: torch.device,
    targets: Optional[Iterable[str]] = None,
) -> dict[str, Any]:
    """Fill every weight (and persistent buffer) of `gm` (`targets`: its get_attr targets; default:
    all of a GraphModule's) from the skeleton `model`'s checkpoint or hashed init, making only
    `specs[target]`'s slices of sharded weights. Returns what was read (or generated)."""
    info = skeleton_info(model)
    known = set(info.params) | set(info.persistent_buffers)
    if targets is None:
        targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]  # type: ignore[union-attr]
    targets = list(dict.fromkeys(targets))
    loaded, kept, full_bytes = 0, [], 0
    source: Union[_CheckpointWeights, _HashedWeights]
    if info.checkpoint is not None:
        source = _CheckpointWeights(info.checkpoint)
    elif info.init is not None:
        source = _HashedWeights(info.init)
    else:
        raise ModelLoadError("a weightless model with neither a checkpoint nor a hashed init to fill it from")
    try:
        for target in targets:
            cur = module_tensor(gm, target)
            if not isinstance(cur, torch.Tensor):
                continue
            name = model_name(target, known)
            if name is None:
                if is_placeholder(cur):
                    raise ModelLoadError(f"graph weight {target} is a placeholder with no model name to load it by")
                continue
            # The model's (unsharded) shape: the graph may already hold this rank's slice.
            is_param = name in info.params
            full = tuple((model.get_parameter(name) if is_param else model.get_buffer(name)).shape)
            spec = specs.get(target)
            if spec is not None and spec.zero:
                t: Optional[torch.Tensor] = torch.zeros(spec.shape(full), dtype=cur.dtype, device=device)
            else:
                t = source.get(info.aliases.get(name, (name,)), full,
                               spec.selection(len(full)) if spec else (None,) * len(full), is_param, cur.dtype, device,
                               block_of(model, name) if is_param else None)
            if t is None:
                kept.append(name)
                continue
            full_bytes += cur.element_size() * int(torch.Size(full).numel())
            if tuple(t.shape) != tuple(cur.shape):
                raise ModelLoadError(f"graph weight {target}: made {list(t.shape)} from {info.source}, the graph "
                                     f"expects {list(cur.shape)} (shard spec: {spec})")
            set_module_tensor(gm, target, t.to(device=device, dtype=cur.dtype).contiguous())
            loaded += 1
        bytes_read = source.bytes_read
    finally:
        source.close()
    left = [t for t in targets if isinstance(module_tensor(gm, t), torch.Tensor) and is_placeholder(module_tensor(gm, t))]
    if left:
        raise ModelLoadError(f"weights still unloaded after filling from {info.source}: {', '.join(left[:5])}")
    return {"checkpoint": info.source, "tensors": loaded, "bytes_read": bytes_read,
            "full_model_bytes": full_bytes, "buffers_kept": kept}


def load_module_weights(model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Fill every placeholder weight (and persistent buffer) of the skeleton `model` whole from its
    checkpoint or hashed init, then unmark it: a full model (how an FP8 checkpoint is loaded by one
    process — its weights stay FP8, never a 16-bit copy)."""
    info = skeleton_info(model)
    report = load_graph_weights(model, model, {}, device, targets=sorted(info.params | info.persistent_buffers))
    del model._autodeploy_skeleton  # type: ignore[attr-defined]
    return report
