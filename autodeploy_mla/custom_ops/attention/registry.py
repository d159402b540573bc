"""Attention backend descriptors, their per-model sessions, and the registry (DESIGN §8).

A descriptor (`MLABackend`) tells the compiler everything it needs to use a backend without knowing
its code: which cached op to call, which metadata fields that op takes (the cache-insertion pass
adds graph inputs for exactly these), what the cache looks like, which constants come from the
source `torch_mla` node, whether the op is a piecewise split point, whether it may live inside a
whole-graph decode CUDA graph, and `check()` — the capability gate that must accept a node's dims
before any kernel of the backend is launched on them.

Descriptors are stateless. Everything a backend keeps between steps (FlashInfer wrappers and plans,
workspaces, block tables, policy knobs, counters) lives in a `BackendSession` that `setup()` returns
and the model owns; the model runner publishes its sessions for the duration of a step
(`step_context.using_sessions`), which is how an op finds its own model's state. Two models in one
process therefore never share or overwrite each other's plans.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

import torch

from .cache_format import UNIT_SCALES, CacheScales, cache_dtype_name
from .mla_dims import MLADims
from .router import NodePaths, Path
from .torch_mla import source_arg

if TYPE_CHECKING:
    import torch.fx

#: Page 0 of every paged cache is a scratch page: the allocator never hands it out, padded tokens
#: write there and padded page-table entries point there. Ops and the runtime share this contract.
SCRATCH_PAGE = 0
#: SM count assumed when a CUDA device is only emulated (CPU tests of GPU backends): an H200's.
EMULATED_SM_COUNT = 132


@dataclass(frozen=True)
class DeviceInfo:
    """What a capability check may know about the target device. Mockable in tests."""

    type: str  # "cpu" | "cuda"
    capability: Optional[tuple[int, int]] = None  # CUDA compute capability, e.g. (9, 0)
    name: str = ""
    sm_count: Optional[int] = None  # streaming multiprocessors (None: unknown / emulated)

    @classmethod
    def of(cls, device: torch.device | str) -> "DeviceInfo":
        device = torch.device(device)
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            return cls("cuda", (props.major, props.minor), props.name, props.multi_processor_count)
        return cls(device.type, None, device.type)

    @property
    def sm(self) -> Optional[int]:
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    @property
    def num_sms(self) -> int:
        return self.sm_count if self.sm_count else EMULATED_SM_COUNT

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
class Target:
    """Where a model will run, as far as capability checks are concerned: the device, the installed
    library versions and the cache page size. One per build; checks never probe the machine."""

    device: DeviceInfo
    versions: Mapping[str, Optional[str]]
    page_size: int

    @classmethod
    def detect(cls, device: torch.device | str, page_size: int) -> "Target":
        """The target of this process's `device` (tests replace this to emulate other GPUs)."""
        return cls(DeviceInfo.of(device), library_versions(), int(page_size))

    def short(self) -> str:
        return f"{self.device.short()}, page_size={self.page_size}"


@dataclass(frozen=True)
class CacheSpec:
    """Per-layer paged cache: [num_pages, page_size, width] of `dtype` (FP8: dequantised with `scales`)."""

    width: int
    dtype: torch.dtype
    scales: CacheScales = UNIT_SCALES

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.itemsize


@dataclass(frozen=True)
class SessionSpec:
    """What `setup()` needs to build a backend's per-model session."""

    dims: tuple[MLADims, ...]  # every node the backend serves in this model
    dtype: torch.dtype  # activations
    device: torch.device
    target: Target
    max_batch_size: int
    max_num_tokens: int
    max_pages_per_seq: int
    #: the paged cache dtype of each node in `dims` (empty: every cache holds `dtype`)
    cache_dtypes: tuple[torch.dtype, ...] = ()
    #: per node in `dims`: the width of the top-k selection a sparse (DSA) layer's attention reads;
    #: 0 for a dense node or a sparse layer's index-key cache (empty: all 0)
    index_topk: tuple[int, ...] = ()
    #: the model's policies of the *other* backends, (name, policy) pairs: a backend that hands steps to
    #: another one makes that one's session with this (else its default), so `attention.<backend>`
    #: settings reach the steps handed to it too
    peer_policies: tuple[tuple[str, Any], ...] = ()

    def policy_of(self, backend: str) -> Any:
        """The model's policy of `backend` (None: its default)."""
        return dict(self.peer_policies).get(backend)

    @property
    def page_size(self) -> int:
        return self.target.page_size

    def node_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.cache_dtypes or (self.dtype,) * len(self.dims)

    def node_index_topk(self) -> tuple[int, ...]:
        return self.index_topk or (0,) * len(self.dims)


#: How a step runs, decided once by the model runner (`StepDescriptor.mode`):
#: "eager" (every piece eagerly: no CUDA graphs, or a token count that is no bucket), "piecewise"
#: (static pieces replayed from their bucket's CUDA graphs, attention eagerly between them),
#: "decode_graph" (one whole-graph decode CUDA graph of the bucket), "mixed_graph" (the bucket's
#: whole-graph mixed CUDA graph, on static bounds).
STEP_MODES: tuple[str, ...] = ("eager", "piecewise", "decode_graph", "mixed_graph")


@dataclass(frozen=True)
class StepDescriptor:
    """What the model runner decided about one step before running it (vLLM's batch descriptor).

    `cuda_graph`: the step may be replayed from (or captured into) a whole-graph CUDA graph, so a
    backend must run it from fixed buffers (FlashInfer's CUDA-graph wrappers).
    `static_bounds`: that graph is the mixed-step graph of its token count, captured on one batch
    and replayed for any other batch of as many tokens (prefill, decode, or both): every launch must
    be sized from static bounds (token count, buffer capacities), never from the step's host counts.
    Only runs graphs whose dynamic ops are all `mixed_graph_safe`.
    `mode` and `bucket`: how the piecewise runner runs it (STEP_MODES) and the token bucket whose
    graphs it replays (None when eager). Decided here, once: the runner and its static pieces read
    them and never decide again (a capture that fails still runs the step piecewise)."""

    num_tokens: int  # real tokens
    num_padded_tokens: int  # tokens the graph runs
    num_seqs: int
    decode_only: bool
    cuda_graph: bool = False
    static_bounds: bool = False
    mode: str = "eager"
    bucket: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"StepDescriptor.mode={self.mode!r}; valid: {', '.join(STEP_MODES)}")
        if (self.bucket is None) != (self.mode == "eager"):
            raise ValueError(f"StepDescriptor: mode {self.mode!r} with bucket {self.bucket}: a bucket is given "
                             "exactly when the step replays graphs (every mode but 'eager')")


class StepMetadata(Protocol):
    """The per-step metadata a backend reads in `prepare` (runtime.SequenceInfo implements it)."""

    def get(self, name: str) -> torch.Tensor: ...


class BackendSession:
    """A backend's state for one model: built by `setup()`, owned by the model's runner.

    `prepare` runs once per step on the host, after the step's metadata is built and before the
    graph runs, never inside a CUDA-graph capture. Stateless backends use this base as it is."""

    backend: str = ""

    def __init__(self, spec: SessionSpec) -> None:
        self.spec = spec

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        """Host-side work once per step (FlashInfer: plan)."""

    def static_bounds_ok(self, meta: StepMetadata) -> bool:
        """Whether this step should run on static bounds (a mixed graph), asked before `prepare` for
        steps the runner would replay that way: a backend whose static-bounds path is much slower
        for this step's shape than its eager path declines, and the step runs piecewise."""
        return True

    def may_decline_static_bounds(self, num_tokens: int, max_seq_len: int) -> bool:
        """Whether `static_bounds_ok` can decline some step of at most `num_tokens` tokens whose
        sequences hold at most `max_seq_len` tokens. The warm-up captures a mixed-graph bucket's
        pieces only when some session may decline one of its steps (those steps run piecewise); a
        session that declines nothing never sends such a step there. Must be True whenever
        `static_bounds_ok` can return False for such a step."""
        return False

    def stats(self) -> dict[str, Any]:
        """Counters for reports and tests (plans, fallback steps, routes, ...)."""
        return {}

    def paths(self, dims: MLADims) -> NodePaths:
        """The node's decode path and prefill path under this session (the build report shows them):
        by default both on this backend's own op."""
        own = Path(self.backend or "own", "every step on this backend's cached op")
        return NodePaths(own, own)


@dataclass(frozen=True)
class SparseOps:
    """The cached ops a backend serves sparse MLA (DSA) layers with: the indexer (selection over the
    layer's index-key cache) and the attention restricted to the selected positions. Both take the
    shared sparse signature (attention/sparse_mla.py), so a step can be handed from one backend's
    sparse op to another's unchanged."""

    indexer: Any
    attention: Any


@dataclass(frozen=True)
class BackendDecision:
    """Which backend serves one MLA node, why, and why each preferred one was rejected."""

    layer: str
    dims: MLADims
    requested: str
    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "dims": vars(self.dims).copy(),
            "requested": self.requested,
            "backend": self.backend,
            "reason": self.reason,
            "rejected": [{"backend": b, "reason": r} for b, r in self.rejected],
        }


class MLABackend:
    """Base descriptor. Subclasses set the class attributes and override `check` (and maybe `setup`)."""

    name: ClassVar[str]
    #: The cached op: op(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *metadata, mla_cache, *constants)
    cached_op: ClassVar[Any]
    #: SequenceInfo field names the op takes, in argument order (`<field>_host` for host mirrors).
    metadata: ClassVar[tuple[str, ...]]
    #: Where this op's facts come from (README links, measurements): shown in reports.
    source: ClassVar[str] = ""
    is_dynamic: ClassVar[bool] = True  # piecewise split point
    #: serves sparse MLA (DSA) layers only: dense resolution never picks it
    sparse_only: ClassVar[bool] = False
    #: the sparse (DSA) ops this backend owns (None: it serves no sparse layer with ops of its own);
    #: split points like `cached_op`
    sparse_ops: ClassVar[Optional[SparseOps]] = None
    #: a backend whose sparse *indexer* op this one runs for its selection (its attention op is
    #: `cached_op`); resolved through the registry (`sparse_ops_of`), so no backend imports another
    sparse_indexer_from: ClassVar[Optional[str]] = None
    #: the backend that serves this dense backend's sparse layers when it is requested for every layer
    sparse_sibling: ClassVar[Optional[str]] = None
    decode_graph_safe: ClassVar[bool] = False  # may run inside a whole-graph decode CUDA graph
    #: `cached_op` may run inside a whole-graph CUDA graph of any step (StepDescriptor.static_bounds);
    #: covers the dense cached op only, never the sparse ops
    mixed_graph_safe: ClassVar[bool] = False
    #: the cached op's implementation with the op's signature, for runtimes that call an eager op
    #: without the dispatcher (the lean path; None: always through the dispatcher)
    direct_call: ClassVar[Optional[Any]] = None

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        raise NotImplementedError

    def split_ops(self) -> tuple[Any, ...]:
        """Every op of this backend the piecewise split cuts the graph at: its cached op (when
        `is_dynamic`) and its own sparse ops."""
        own = (self.cached_op,) if self.is_dynamic else ()
        sparse = (self.sparse_ops.attention, self.sparse_ops.indexer) if self.sparse_ops is not None else ()
        return own + sparse

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        """Whether this backend reads and writes a paged cache of `cache_dtype` for the node (checked
        after `check`). By default only a cache of the activations' dtype; FP8-capable backends override."""
        if cache_dtype == dtype:
            return CheckResult(True, "cache in the model dtype")
        return CheckResult(False, f"{self.name} reads only a cache of the activations' dtype "
                                  f"({cache_dtype_name(dtype)}), not {cache_dtype_name(cache_dtype)}")

    def cache_spec(self, dims: MLADims, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None,
                   scales: CacheScales = UNIT_SCALES) -> CacheSpec:
        return CacheSpec(width=dims.kv_lora_rank + dims.qk_rope_head_dim,
                         dtype=dtype if cache_dtype is None else cache_dtype, scales=scales)

    def constants(self, node: "torch.fx.Node") -> tuple[Any, ...]:
        """Constants appended after the cache: the softmax scale (None = default)."""
        scale = source_arg(node, "scale")
        return (None if scale is None else float(scale),)

    #: the policy dataclass `setup` takes (None: the backend has no knobs): the config's `attention:`
    #: section of this backend is turned into one (`policy_from_config`)
    policy_type: ClassVar[Optional[type]] = None

    def policy_from_config(self, fields: Mapping[str, Any]) -> Any:
        """This backend's policy from its `attention:` config section (None when it has no knobs).
        Sequences become tuples (the policies are frozen values)."""
        if self.policy_type is None:
            if fields:
                raise ValueError(f"attention.{self.name}: this backend has no policy knobs (got {sorted(fields)})")
            return None
        return self.policy_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})

    def setup(self, spec: SessionSpec, policy: Any = None) -> BackendSession:
        """This backend's session for one model: validates every node it will serve first."""
        self.check_all(spec)
        sess = BackendSession(spec)
        sess.backend = self.name
        return sess

    def check_all(self, spec: SessionSpec) -> None:
        """Raise ValueError naming the first node of `spec` this backend cannot serve."""
        for d, cache_dtype in zip(spec.dims, spec.node_cache_dtypes()):
            res = self.check(d, spec.dtype, spec.target)
            if res.ok:
                res = self.check_cache(d, spec.dtype, cache_dtype, spec.target)
            if not res.ok:
                raise ValueError(f"{self.name}.setup: cannot serve {d.short()} {spec.dtype} "
                                 f"(cache {cache_dtype_name(cache_dtype)}) on {spec.target.short()}: "
                                 f"{res.reason}")


# The registry maps names to stateless descriptors. Backends register themselves when their module
# is imported (custom_ops/__init__.py imports them all); nothing changes it afterwards.
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


def sparse_ops_of(name: str) -> SparseOps:
    """The (indexer, attention) cached ops that serve a sparse layer resolved to backend `name`: its own
    sparse ops, or its cached op with the indexer of the backend it declares (`sparse_indexer_from`)."""
    be = get_backend(name)
    if be.sparse_ops is not None:
        return be.sparse_ops
    if be.sparse_only and be.sparse_indexer_from is not None:
        return SparseOps(indexer=sparse_ops_of(be.sparse_indexer_from).indexer, attention=be.cached_op)
    serving = sorted(n for n, b in _REGISTRY.items() if b.sparse_ops is not None or b.sparse_only)
    raise KeyError(f"MLA backend {name!r} serves no sparse (DSA) layer; those that do: {', '.join(serving)}")


def sparse_backends() -> tuple[str, ...]:
    """Backends with sparse attention ops of their own (a sparse step can be handed to any of them)."""
    return tuple(n for n, b in _REGISTRY.items() if b.sparse_ops is not None)


def direct_calls() -> dict[Any, Any]:
    """Cached op overload -> its backend's `direct_call`, for every backend that offers one."""
    out: dict[Any, Any] = {}
    for b in _REGISTRY.values():
        if b.direct_call is not None:
            out[getattr(b.cached_op, "default", b.cached_op)] = b.direct_call
    return out


def policies_for(config_sections: Mapping[str, Mapping[str, Any]],
                 overrides: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """backend -> policy for one model: each backend's policy from the keys its `attention:` config
    section sets (`MLABackend.policy_from_config`), then `overrides` (backend -> policy object, the
    Python `backend_policies=`) replacing whole policies. Backends with neither are left out (their
    `setup` takes its defaults)."""
    out: dict[str, Any] = {}
    for name, fields in config_sections.items():
        try:
            out[name] = get_backend(name).policy_from_config(fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"attention.{name}: {exc}") from None
    out.update(overrides or {})
    return out


def make_session_spec(dims: Sequence[MLADims], dtype: torch.dtype, device: torch.device | str, target: Target,
                      max_batch_size: int, max_num_tokens: int, max_pages_per_seq: int,
                      cache_dtypes: Sequence[torch.dtype] = ()) -> SessionSpec:
    return SessionSpec(tuple(dims), dtype, torch.device(device), target, int(max_batch_size), int(max_num_tokens),
                       int(max_pages_per_seq), tuple(cache_dtypes))
