"""Attention backend descriptors and their registry (DESIGN §8).

A descriptor tells the compiler everything it needs to use a backend without knowing its code:
which cached op to call, which metadata fields that op takes (the cache-insertion pass adds graph
placeholders for exactly these), what the cache looks like, which constants come from the source
`torch_mla` node, a host-side `prepare` hook run once per step, whether the op is a piecewise split
point, whether it may live inside a full decode CUDA graph, and `check()` — the capability gate that
must accept a node's dims before any kernel of the backend is launched on them.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from .mla_dims import MLADims

if TYPE_CHECKING:
    import torch.fx

    from ..runtime.sequence_info import SequenceInfo


@dataclass(frozen=True)
class DeviceInfo:
    """What a capability check may know about the target device. Mockable in tests."""

    type: str  # "cpu" | "cuda"
    capability: Optional[tuple[int, int]] = None  # CUDA compute capability, e.g. (9, 0)
    name: str = ""

    @classmethod
    def of(cls, device: torch.device | str) -> "DeviceInfo":
        device = torch.device(device)
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            return cls("cuda", tuple(torch.cuda.get_device_capability(idx)), torch.cuda.get_device_name(idx))
        return cls(device.type, None, device.type)

    @property
    def sm(self) -> Optional[int]:
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    def short(self) -> str:
        return f"{self.type}" + (f" SM{self.sm}" if self.sm is not None else "")


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def library_versions() -> dict[str, Optional[str]]:
    """Installed versions of the libraries backends depend on (None = absent). Does not import them."""
    out: dict[str, Optional[str]] = {}
    for dist, key in (("torch", "torch"), ("triton", "triton"), ("flashinfer-python", "flashinfer")):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    return out


def parse_version(v: Optional[str]) -> Optional[tuple[int, int, int]]:
    """'0.6.18.post1' -> (0, 6, 18). None for absent or unparsable."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v or "")
    return None if m is None else (int(m[1]), int(m[2]), int(m[3] or 0))


@dataclass(frozen=True)
class CacheSpec:
    """Per-layer paged cache: [num_pages, page_size, width] of `dtype`."""

    width: int
    dtype: torch.dtype


# Schema of the source op, read once: lets constants be taken positionally or by keyword.
_SOURCE_ARGS = ("q_nope", "q_pe", "compressed_kv", "kpe", "kv_b_proj_weight", "is_causal", "scale", "layout")
_SOURCE_DEFAULTS: dict[str, Any] = {"is_causal": True, "scale": None, "layout": "bsnd"}


def source_arg(node: "torch.fx.Node", name: str) -> Any:
    """Argument `name` of a `torch_mla` node, whether passed positionally, by keyword, or defaulted."""
    idx = _SOURCE_ARGS.index(name)
    if name in node.kwargs:
        return node.kwargs[name]
    if idx < len(node.args):
        return node.args[idx]
    return _SOURCE_DEFAULTS.get(name)


class MLABackend:
    """Base descriptor. Subclasses set the class attributes and override `check` (and maybe more)."""

    name: ClassVar[str]
    #: The cached op: op(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *metadata, mla_cache, *constants)
    cached_op: ClassVar[Any]
    #: SequenceInfo field names the op takes, in argument order (`<field>_host` for host mirrors).
    metadata: ClassVar[tuple[str, ...]]
    #: Where this op's facts come from (README links, measurements): shown in reports.
    source: ClassVar[str] = ""
    is_dynamic: ClassVar[bool] = True  # piecewise split point
    decode_graph_safe: ClassVar[bool] = False  # may run inside a whole-graph decode CUDA graph

    def check(
        self,
        dims: MLADims,
        dtype: torch.dtype,
        device: DeviceInfo,
        versions: Mapping[str, Optional[str]],
        page_size: int,
    ) -> CheckResult:
        raise NotImplementedError

    def cache_spec(self, dims: MLADims, dtype: torch.dtype) -> CacheSpec:
        return CacheSpec(width=dims.kv_lora_rank + dims.qk_rope_head_dim, dtype=dtype)

    def constants(self, node: "torch.fx.Node") -> tuple[Any, ...]:
        """Constants appended after the cache: the softmax scale (None = default)."""
        scale = source_arg(node, "scale")
        return (None if scale is None else float(scale),)

    def setup(self, dims: list[MLADims], dtype: torch.dtype, seq_info: "SequenceInfo") -> None:
        """Called once after the graph is built, with the dims of every node this backend serves."""

    def prepare(self, seq_info: "SequenceInfo") -> None:
        """Host-side work once per step, after metadata is built, outside any CUDA graph."""


_REGISTRY: dict[str, MLABackend] = {}


def register_backend(cls: type[MLABackend]) -> type[MLABackend]:
    if cls.name in _REGISTRY:
        raise ValueError(f"MLA backend {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get_backend(name: str) -> MLABackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown MLA backend {name!r}; valid: {', '.join(sorted(_REGISTRY))}") from None


def all_backends() -> dict[str, MLABackend]:
    return dict(_REGISTRY)


def cached_ops() -> set[Any]:
    """Every registered cached op (packets and their default overloads): the piecewise split points."""
    ops: set[Any] = set()
    for b in _REGISTRY.values():
        if b.is_dynamic:
            ops.add(b.cached_op)
            ops.add(getattr(b.cached_op, "default", b.cached_op))
    return ops
