"""`torch.ops.autodeploy.triton_mla_with_cache` and its descriptor `TritonMLABackend` ("triton").

Same contract as the torch reference op (torch_backend.py): append the step's tokens to the paged
latent cache, then attend — prefill tokens causally over (cached prefix + new tokens), decode
tokens over their whole history — for a mixed flat batch in one call. See docs/triton_backend.md.

Plan of one call (host decisions read only `*_host` metadata; nothing syncs the device):

1. `append_kernel` over the step's real tokens.
2. Prefill part (if any): the cost rule `tuning.choose_prefill_path` picks
   - "expand": gather the prefill sequences' history, K/V = latent @ kv_b_proj^T (one GEMM), then
     `expanded_prefill_kernel` (FlashAttention-style) writes the output directly; or
   - "absorb": the prefill tokens join the absorbed path below.
3. Absorbed tokens (decode tokens, plus prefill tokens on the "absorb" path): q_abs = q_nope·W_kn
   (bmm), `absorbed_attn_kernel` (+ `split_reduce_kernel` when split-K), out = latent·W_v (bmm).

A step on static bounds (a mixed CUDA graph, replayed for any batch of its token count) runs
`_attend_static` instead: every token appended and absorbed in one launch sized by the token count
and the sequence capacity only.

The op reads its model's `TritonMLASession` from the step context when there is one: its policy
(forced prefill path or split count for benchmarks, NaN-poisoned buffers for tests), the step's
host shape and launch plans made once per step for all layers, and the compiled kernels it launches
directly (launch.py). Called outside a model step it runs with the default policy, plans for that
call alone and launches through Triton's JIT launcher (docs/triton_backend.md, "The lean eager path").
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import torch

from ..attention.registry import (BackendSession, CheckResult, MLABackend, SessionSpec, StepDescriptor, StepMetadata, Target,
                                parse_version, register_backend)
from ..attention.cache_format import FP8_DTYPE, FP8_MAX, UNIT_SCALES, CacheScales, cache_dtype_name, is_fp8
from ..attention.mla_dims import MLADims, MLAShapeError, resolve_scale
from ..attention.contract import MLAInputs, check_cached_inputs, define_cached_op_and_kernel
from ..attention.step_context import active_session
from . import gluon_decode as GD
from . import tuning
from .sparse import DSA_INDEXER_WITH_CACHE as SPARSE_INDEXER_WITH_CACHE
from .sparse import triton_mla_sparse_with_cache
from ..flashinfer.fa3_prefill import Fa3Prefill, fa3_unavailable
from ..triton_helpers import dot_precision, interpreting, pow2
from .launch import BoundKernel, LaunchCache
from .tuning import (
    MAX_EXPAND_HEAD_DIM,
    MAX_KV_LORA_RANK,
    MAX_ROPE_DIM,
    MULTI_TOKEN_MAX_Q,
    STATIC_MAX_EXTRA_FLOPS,
    absorb_prefill_config,
    choose_prefill_path,
    decode_config,
    expand_config,
    expansion_supported,
    heads_on_n_supported,
    max_static_bounds_extra_flops,
    multi_token_config,
    min_chunk,
    nope_chunks,
    num_sms,
    resident_programs,
    split_plan,
    split_plan_waves,
    static_bounds_extra_flops,
    validate_dims,
)

try:  # Triton is optional: without it the op is registered but check() refuses every node.
    import triton

    from . import kernels as K

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR = ""
except ImportError as e:  # pragma: no cover - exercised only without triton
    triton = None
    K = None
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = str(e)

OP = "triton_mla_with_cache"
METADATA: tuple[str, ...] = (
    "batch_info_host",
    "max_seq_info_host",
    "cu_seqlen_host",
    "input_pos_host",
    "cu_seqlen",
    "input_pos",
    "seq_len_with_cache",
    "page_table",
    "cache_loc",
)
LOG2E = 1.4426950408889634
PREFILL_MODES = ("auto", "expand", "absorb")
DECODE_LAYOUTS = ("auto", "heads_on_m", "heads_on_n")
DECODE_KERNELS = ("auto", "triton", "gluon")
PREFILL_ATTENTION = ("auto", "triton", "flashinfer")


# ----------------------------------------------------------------------------- session
@dataclass(frozen=True)
class TritonPolicy:
    """Per-model knobs of the Triton backend (defaults: what graphs run).

    prefill_mode: "auto" (the cost rule), or force "expand" / "absorb" (benchmarks, tests).
    decode_splits: 0 = split-K from the policy in tuning.py; k >= 1 forces k chunks (also for
    absorbed prefill). poison_buffers: fill every intermediate/output buffer with NaN before the
    kernels run, so an element a kernel forgets to write shows up as NaN (tests). fp8_dot: with an
    FP8 cache, quantise the absorbed queries (per-call amax scale) and the probabilities to e4m3 and
    run both products as e4m3 MMAs on the tiles as loaded, instead of converting each cache tile to
    the query dtype (the default: exact queries). Off: on H200 it was no faster at N <= 32 and 2.5x
    slower at N = 128, with twice the error (docs/benchmarks/fp8_cache.md). decode_layout: "auto"
    (tuning.decode_config's measured choice), or force the decode kernel: "heads_on_m"
    (absorbed_attn_kernel) / "heads_on_n" (absorbed_attn_heads_on_n_kernel, where R >= 32).
    prefill_attention: the attention kernel of the expanded prefill: "auto" = FlashInfer's FA3 ragged
    prefill (fa3_prefill.py) where it is installed and serves the dims (SM90, qk/vo head dims it is
    built for) and the step's longest prefill has at least tuning.FA3_PREFILL_MIN_TOKENS new tokens,
    else `expanded_prefill_kernel`; "triton" / "flashinfer" force one ("flashinfer" where FA3 cannot
    run is refused when the session is made). decode_kernel: "auto" = the warp-specialised Gluon decode
    kernels wherever `gluon_decode.supports` accepts the dims and device (SM90, 16-bit cache, R 256/512
    with N <= 32 or R 512 with N > 32, Dr 64, pages of whole 64-token tiles) and, at N <= 32, decode
    runs heads-on-N (gluon_decode.py; N > 32: gluon_decode_wide.py), else the `tl` kernels;
    "triton" never uses them; "gluon" requires them (a decode they cannot serve raises, naming why)."""

    prefill_mode: Literal["auto", "expand", "absorb"] = "auto"
    decode_splits: int = 0
    poison_buffers: bool = False
    fp8_dot: bool = False
    decode_layout: Literal["auto", "heads_on_m", "heads_on_n"] = "auto"
    prefill_attention: Literal["auto", "triton", "flashinfer"] = "auto"
    decode_kernel: Literal["auto", "triton", "gluon"] = "auto"

    def __post_init__(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"TritonPolicy.decode_kernel={self.decode_kernel!r}; expected one of "
                             f"{', '.join(DECODE_KERNELS)}.")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"TritonPolicy.prefill_attention={self.prefill_attention!r}; expected one of "
                             f"{', '.join(PREFILL_ATTENTION)}.")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"TritonPolicy.prefill_mode={self.prefill_mode!r}; expected one of {', '.join(PREFILL_MODES)}.")
        if self.decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"TritonPolicy.decode_layout={self.decode_layout!r}; expected one of "
                             f"{', '.join(DECODE_LAYOUTS)}.")
        if self.decode_splits < 0:
            raise ValueError(f"TritonPolicy.decode_splits={self.decode_splits}: must be >= 0 (0 = automatic).")


DEFAULT_POLICY = TritonPolicy()


class TritonMLASession(BackendSession):
    """The Triton backend's state for one model: its policy, the kernel variants already loaded, the
    compiled kernels it launches directly (`LaunchCache`), and the step plan `prepare` makes once per
    step for every layer: the step's host shape (`StepShape`) and, filled by the first layer of each
    kind of node, the launch plans the other layers of that kind reuse."""

    backend = "triton"

    def __init__(self, spec: SessionSpec, policy: TritonPolicy = DEFAULT_POLICY) -> None:
        super().__init__(spec)
        self.policy = policy
        #: (kernel config, dims, dtype, device, page size) whose SPLIT and non-SPLIT variants are loaded.
        self.warmed: set[tuple[Any, ...]] = set()
        self.launches = LaunchCache()
        #: this step's host shape (None before the first prepare: ops then read the host metadata)
        self.step: Optional[StepShape] = None
        #: this step's launch plans by node kind and role (cleared by prepare)
        self.plans: dict[tuple[Any, ...], Any] = {}
        #: steps whose static-bounds (mixed graph) run this session declined (static_bounds_ok)
        self.static_declined = 0
        #: what every op call of this model runs with (the dicts above and below are shared with it)
        #: FlashInfer's FA3 prefill for the expanded prefill's attention (None: our kernel), and why not
        self.fa3, self.fa3_reason = _make_fa3(spec, policy)
        self.call = _Call(policy, self.warmed, self.launches, self.plans, descriptors={}, views={},
                          memo_limit=2 * len(spec.dims) + 8, fa3=self.fa3)

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        """Read the step's host metadata once for all layers (ops check the batch counts still match)."""
        self.step = StepShape.from_host(meta.get("batch_info_host"), meta.get("max_seq_info_host"),
                                        meta.get("cu_seqlen_host"), meta.get("input_pos_host"),
                                        static=step.static_bounds)
        self.plans.clear()

    def static_bounds_ok(self, meta: StepMetadata) -> bool:
        """Static bounds absorb the prefill part (no expansion in a graph): decline steps where that
        costs more than tuning.STATIC_MAX_EXTRA_FLOPS per layer over expanding (long-prefix chunks),
        unless the policy forces absorption."""
        shape = StepShape.from_host(meta.get("batch_info_host"), meta.get("max_seq_info_host"),
                                    meta.get("cu_seqlen_host"), meta.get("input_pos_host"))
        if shape.n_pre == 0 or self.policy.prefill_mode == "absorb":
            return True
        ok = self.policy.prefill_mode == "auto" and all(
            static_bounds_extra_flops(d, shape.n_pre_tok, shape.prefix, shape.pairs) <= STATIC_MAX_EXTRA_FLOPS
            for d in set(self.spec.dims))
        if not ok:
            self.static_declined += 1
        return ok

    def may_decline_static_bounds(self, num_tokens: int, max_seq_len: int) -> bool:
        """`static_bounds_ok` declines only steps with a prefill part: never under prefill_mode
        "absorb", always under "expand", and under "auto" where the largest extra cost any such step can
        reach (tuning.max_static_bounds_extra_flops) is over STATIC_MAX_EXTRA_FLOPS for some layer."""
        mode = self.policy.prefill_mode
        if mode == "absorb":
            return False
        if mode != "auto":
            return True
        return any(max_static_bounds_extra_flops(d, num_tokens, max_seq_len) > STATIC_MAX_EXTRA_FLOPS
                   for d in set(self.spec.dims))

    def stats(self) -> dict[str, Any]:
        fa3 = self.fa3.stats() if self.fa3 is not None else {"fa3_prefill": self.fa3_reason}
        return {"warmed_variants": len(self.warmed), "step_plans": len(self.plans),
                "static_bounds_declined": self.static_declined, **self.launches.stats(), **fa3}


def _make_fa3(spec: SessionSpec, policy: TritonPolicy) -> tuple[Optional[Fa3Prefill], str]:
    """The session's FA3 prefill (policy "auto"/"flashinfer", every layer's dims served), or why none."""
    if policy.prefill_attention == "triton":
        return None, "off (prefill_attention='triton')"
    if policy.prefill_attention == "auto" and spec.max_num_tokens < tuning.FA3_PREFILL_MIN_TOKENS:
        # steps never hold that many tokens: no workspace for a path "auto" cannot take
        return None, (f"max_num_tokens {spec.max_num_tokens} < FA3_PREFILL_MIN_TOKENS "
                      f"{tuning.FA3_PREFILL_MIN_TOKENS}: no step is long enough for FA3")
    why = next((w for w in (fa3_unavailable(d, spec.dtype, spec.device) for d in sorted(set(spec.dims), key=str))
                if w), "")
    if why:
        if policy.prefill_attention == "flashinfer":
            raise ValueError(f"TritonPolicy.prefill_attention='flashinfer': {why}. Use 'auto' or 'triton'.")
        return None, why
    return Fa3Prefill(spec.device, frozenset((d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim)
                                             for d in spec.dims)), ""


@dataclass(frozen=True)
class StepShape:
    """Host facts of one step that every layer's launch decisions read (DESIGN §7 host mirrors)."""

    n_pre: int  # prefill sequences (chunked-prefill continuations included)
    n_pre_tok: int  # their new tokens
    n_dec: int  # decode sequences (one token each)
    max_q: int
    max_kv: int
    prefix: int  # cached tokens under the prefill sequences
    pairs: int  # causal (query, key) pairs of the prefill part
    #: the step runs in a whole-graph CUDA graph captured for any batch of its token count
    #: (StepDescriptor.static_bounds): launches are sized from static bounds only (`_attend_static`)
    static: bool = False
    #: the prefill sequences' new-token and kv-length offsets [0, ...] (n_pre + 1 each; FA3's plan)
    qo_indptr: tuple[int, ...] = ()
    kv_indptr: tuple[int, ...] = ()

    @property
    def num_tok(self) -> int:
        return self.n_pre_tok + self.n_dec

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return (self.n_pre, self.n_pre_tok, self.n_dec, self.max_q, self.max_kv)

    @classmethod
    def from_host(cls, batch_info_host: torch.Tensor, max_seq_info_host: torch.Tensor,
                  cu_seqlen_host: torch.Tensor, input_pos_host: torch.Tensor, static: bool = False) -> "StepShape":
        """From the `_host` mirrors (CPU tensors: reading them never syncs the device)."""
        n_pre, n_pre_tok, n_dec = (int(v) for v in batch_info_host.tolist()[:3])
        max_q, max_kv = (int(v) for v in max_seq_info_host.tolist()[:2])
        prefix = pairs = 0
        qo_indptr: tuple[int, ...] = ()
        kv_indptr: tuple[int, ...] = ()
        if n_pre > 0:
            cu = cu_seqlen_host[: n_pre + 1].numpy().astype("int64")
            q = cu[1:] - cu[:-1]
            p = input_pos_host[:n_pre].numpy().astype("int64")
            prefix, pairs = int(p.sum()), int((q * p + q * (q + 1) // 2).sum())
            qo_indptr = tuple(int(v) for v in cu - cu[0])
            kv_indptr = (0, *(int(v) for v in (p + q).cumsum()))
        return cls(n_pre, n_pre_tok, n_dec, max_q, max_kv, prefix, pairs, static, qo_indptr, kv_indptr)


@dataclass
class _Call:
    """What one op call runs with: the policy, and from its model's session the kernel variants
    already loaded, the compiled kernels to launch directly and the step's plans. Outside a model step
    (no session) they are None: kernels go through Triton's JIT launcher and nothing is remembered."""

    policy: TritonPolicy
    warmed: Optional[set[tuple[Any, ...]]] = field(default=None)
    launches: Optional[LaunchCache] = field(default=None)
    plans: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: the session's per-cache TMA descriptors
    descriptors: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: the session's (W_kn, W_v) views per kv_b_proj weight
    views: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: entries the two per-model tables above may hold before they are cleared
    memo_limit: int = 64
    #: the session's FlashInfer FA3 prefill (None: the expanded prefill's attention is our kernel)
    fa3: Optional[Fa3Prefill] = field(default=None)

    def empty(self, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.policy.poison_buffers:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(*shape, dtype=dtype, device=device)

    def bound(self, fn: Any, constexprs: dict[str, Any]) -> BoundKernel:
        if self.launches is None:
            return BoundKernel(fn, constexprs)
        return self.launches.get(fn, constexprs)

    def plan(self, key: tuple[Any, ...], make: Any) -> Any:
        """The step's plan for `key`: made by `make()` once per step when there is a session."""
        if self.plans is None:
            return make()
        got = self.plans.get(key)
        if got is None:
            got = self.plans[key] = make()
        return got


def _capturing_on(dev: torch.device) -> bool:
    """True while a CUDA graph is being captured on `dev`'s stream (then only static bounds may size
    the grid). A CPU op never captures: no CUDA query."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- launchers
APPEND_BLOCK_T = 16


def _append_kernel(call: _Call, dims: MLADims, cache_dtype: torch.dtype) -> BoundKernel:
    r, dr = dims.kv_lora_rank, dims.qk_rope_head_dim
    return call.bound(K.append_kernel, dict(R=r, DR=dr, BLOCK_T=APPEND_BLOCK_T, BLOCK_R=pow2(r), BLOCK_DR=pow2(dr),
                                            QUANT=is_fp8(cache_dtype), EXACT_CAST=interpreting(), num_warps=4))


def _launch_append(compressed_kv, kpe, mla_cache, cache_loc, num_tok, dims, scales: CacheScales = UNIT_SCALES,
                   call: Optional[_Call] = None):
    """append_kernel over the first `num_tok` tokens (the cache is passed whole: its rows are
    [num_pages * page_size, R + Dr] with row stride mla_cache.stride(1))."""
    call = call or _Call(DEFAULT_POLICY)
    bk = call.plan(("append", dims, mla_cache.dtype), lambda: _append_kernel(call, dims, mla_cache.dtype))
    bk.launch((triton.cdiv(num_tok, APPEND_BLOCK_T),), (compressed_kv, kpe, mla_cache, cache_loc),
              (num_tok, 1.0 / scales.latent, 1.0 / scales.rope, compressed_kv.stride(1), kpe.stride(1),
               mla_cache.stride(1)))


def _scaled(mla_cache: torch.Tensor, scales: CacheScales) -> bool:
    """Whether the kernels must apply the cache's scales (an FP8 cache with scales other than 1)."""
    return is_fp8(mla_cache.dtype) and not scales.identity


def quantize_queries(q_abs: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_abs / s0, q_pe / s1 in e4m3, [s0, s1] fp32 on the device): per-call scales from each part's
    amax (no host sync), for the FP8_DOT kernels."""
    pe_amax = q_pe.abs().amax() if q_pe.numel() else q_abs.new_zeros(())  # Dr = 0: no rope part
    amax = torch.stack([q_abs.abs().amax(), pe_amax]).float()
    qs = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (q_abs.float() / qs[0]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    qpe8 = (q_pe.float() / qs[1]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q8, qpe8, qs


def _heads_on_n_descriptors(flat: torch.Tensor, block_n: int, block_c: int, dr: int):
    """(latent, rope) tensor descriptors of whole one-page KV tiles of one layer's cache, or
    (None, None) where its rows are not 16-byte aligned. The config and the device were checked by
    the launch plan (`_AbsorbedLaunch.tma_ok`: TMA asked for, SM90+, tiles inside one page)."""
    if (flat.stride(0) * flat.element_size()) % 16 or flat.data_ptr() % 16:
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(flat, [block_n, block_c]),
            TensorDescriptor.from_tensor(flat, [block_n, pow2(dr)]) if dr else None)


def _reduce_meta(r: int) -> dict[str, Any]:
    return dict(R=r, BLOCK_R=pow2(r), num_warps=4 if r <= 256 else 8)


@dataclass(frozen=True)
class _AbsorbedLaunch:
    """One absorbed launch of a step, planned once for every layer of the same kind: the attention
    kernel (+ split merge), grid, split count and chunk."""

    attn: BoundKernel
    reduce: Optional[BoundKernel]
    grid: tuple[int, int, int]
    splits: int
    chunk: int
    heads_on_n: bool
    block_c: int
    tma_ok: bool  # the config asks for TMA tiles and the device has them (the cache's alignment is per layer)


def _plan_absorbed(call: _Call, cfg, dims: MLADims, q_dtype: torch.dtype, mla_cache: torch.Tensor, scaled: bool,
                   fp8_dot: bool, n_seqs: int, max_q: int, kv_bound: int, dev: torch.device,
                   work_list: int = 0, max_splits: int = 0) -> _AbsorbedLaunch:
    """work_list > 0 (static bounds): one program per (work item, head block) over all sequences,
    items found in the kernel from the device cu_seqlen (`kernels._work_item`), `work_list` = the
    sequence capacity and `max_q` = the token count (at most ceil(T / BLOCK_Q) + sequences items,
    and at most T). The split count comes from `kv_bound` (under capture: the capacity); the kernel
    cuts each program's history into that many chunks of at least min_chunk (`_absorbed_work`).
    max_splits > 0 caps the split count."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    num_hb = triton.cdiv(n, cfg.block_h)
    if work_list:
        num_qb, n_seqs = min(max_q, triton.cdiv(max_q, cfg.block_q) + work_list), 1
    else:
        num_qb = triton.cdiv(max_q, cfg.block_q)
    progs = n_seqs * num_hb * num_qb
    page_size = mla_cache.shape[1]
    if cfg.heads_on_n:
        width = pow2(r) + (pow2(dr) if dr else 0)
        partial = cfg.block_h * cfg.block_q * r * 8 / (cfg.block_n * width * mla_cache.element_size())
        splits, chunk = split_plan_waves(progs, kv_bound, cfg.block_n, call.policy.decode_splits, dev,
                                         num_sms(dev) * resident_programs(cfg, dims, mla_cache.element_size(), dev),
                                         partial)
    else:
        splits, chunk = split_plan(progs, kv_bound, cfg.block_n, call.policy.decode_splits, dev)
    if max_splits and splits > max_splits:
        splits, chunk = split_plan(progs, kv_bound, cfg.block_n, max_splits, dev)
    # The kernel cuts each program's own history into `splits` chunks of at least this (whole tiles):
    # the plan fixes only the split count.
    chunk = min(chunk, -(-min_chunk(dev) // cfg.block_n) * cfg.block_n)
    meta = dict(
        N=n, R=r, DR=dr, PAGE_SIZE=page_size, NUM_HB=num_hb, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, BLOCK_DR=pow2(dr), DOT_PREC=dot_precision(q_dtype), SCALED=scaled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if work_list:
        meta.update(B_CAP=work_list, B_PAD=pow2(work_list))
    block_c = 0
    tma_ok = False
    if cfg.heads_on_n:
        if fp8_dot:
            raise AssertionError("FP8_DOT runs on absorbed_attn_kernel only (decode_config picks it)")
        kernel = K.absorbed_attn_heads_on_n_kernel
        block_c = max(16, pow2(r) // 2)
        tma_ok = (cfg.tma and dev.type == "cuda" and page_size % cfg.block_n == 0
                  and torch.cuda.get_device_capability(dev) >= (9, 0))
        meta.update(BLOCK_C=block_c, F16=is_fp8(mla_cache.dtype) and q_dtype == torch.bfloat16,
                    WS=cfg.warp_spec and dev.type == "cuda" and not interpreting())
    else:
        kernel = K.absorbed_attn_kernel
        meta.update(BLOCK_R=pow2(r), FP8_DOT=fp8_dot, EXACT_CAST=interpreting())
    split = splits > 1
    if cfg.heads_on_n:  # USE_TMA is decided per layer (the cache's alignment): both variants may run
        attn = call.bound(kernel, {**meta, "SPLIT": split, "USE_TMA": tma_ok})
    else:
        attn = call.bound(kernel, {**meta, "SPLIT": split})
    reduce = call.bound(K.split_reduce_kernel, {**_reduce_meta(r), "B_CAP": work_list}) if split else None
    return _AbsorbedLaunch(attn, reduce, (num_hb * num_qb, n_seqs, splits), splits, chunk, cfg.heads_on_n, block_c,
                           tma_ok)


def _launch_absorbed(call: _Call, q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len, latent,
                     *, seq_base, n_seqs, tok_base, n_tok, abs_base, max_q, kv_bound, cfg, dims, qk_scale,
                     scales: CacheScales = UNIT_SCALES, q_scale: Optional[torch.Tensor] = None,
                     work_list: int = 0, max_splits: int = 0) -> int:
    """`q_scale` given: q_abs / q_pe are e4m3 (quantize_queries) and the kernel runs e4m3 MMAs.
    `cfg.heads_on_n`: absorbed_attn_heads_on_n_kernel (never with q_scale). `work_list`,
    `max_splits`: see _plan_absorbed (static bounds). Returns the split count."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    scaled = _scaled(mla_cache, scales) or q_scale is not None
    fp8_dot = q_scale is not None
    key = ("absorbed", cfg, dims, q_abs.dtype, mla_cache.dtype, mla_cache.shape[1], scaled, fp8_dot, n_seqs, max_q,
           kv_bound, work_list, max_splits)
    plan = call.plan(key, lambda: _plan_absorbed(call, cfg, dims, q_abs.dtype, mla_cache, scaled, fp8_dot, n_seqs,
                                                  max_q, kv_bound, dev, work_list, max_splits))
    splits, chunk = plan.splits, plan.chunk
    flat_stride = mla_cache.stride(1)
    if plan.heads_on_n:
        descs = _cache_descriptors(call, mla_cache, cfg, plan.block_c, dr) if plan.tma_ok else (None, None)
        attn = plan.attn
        if plan.tma_ok and descs[0] is None:  # this layer's cache cannot take TMA: the pointer variant
            attn = call.bound(attn.fn, {**attn.constexprs, "USE_TMA": False})
        extra: tuple[Any, ...] = descs
    else:
        attn = plan.attn
        extra = (latent if q_scale is None else q_scale,)

    def args(part_acc, part_lse):
        is_split = part_acc is not latent
        pa = part_acc.stride()[:3] if is_split else (0, 0, 0)
        pl = part_lse.stride()[:2] if is_split else (0, 0)
        ptrs = (q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len, latent, part_acc, part_lse, *extra)
        scalars = (seq_base, tok_base, abs_base, chunk, qk_scale, scales.latent, scales.rope,
                   q_abs.stride(0), q_abs.stride(1), q_pe.stride(1), q_pe.stride(2),
                   flat_stride, page_table.stride(0), latent.stride(0), latent.stride(1), *pa, *pl)
        red = (tok_base, abs_base, splits, *pa, *pl, latent.stride(0), latent.stride(1))
        return ptrs, scalars, (part_acc, part_lse, latent, cu_seqlen), red

    if dev.type == "cuda" and not _capturing_on(dev):
        # Load both variants (SPLIT or not) now, in eager mode: a decode step captured into a CUDA
        # graph later plans its splits from the static capacity and may need the other variant,
        # and loading a kernel module while a stream is capturing is not allowed.
        wkey = (cfg, dims, q_abs.dtype, mla_cache.dtype, scaled, fp8_dot, dev, mla_cache.shape[1], extra[0] is None,
                work_list)
        if call.warmed is None or wkey not in call.warmed:
            dummy_acc = torch.empty(1, n, 2, r, dtype=torch.float32, device=dev)
            dummy_lse = torch.empty(1, n, 2, dtype=torch.float32, device=dev)
            for pa_, pl_, sp in ((latent, latent, False), (dummy_acc, dummy_lse, True)):
                ptrs, scalars, rptrs, red = args(pa_, pl_)
                call.bound(attn.fn, {**attn.constexprs, "SPLIT": sp}).warmup(ptrs, scalars)
                if sp:
                    call.bound(K.split_reduce_kernel, {**_reduce_meta(r), "B_CAP": work_list}).warmup(rptrs, red)
            if call.warmed is not None:
                call.warmed.add(wkey)

    if splits > 1:
        part_acc = call.empty(n_tok, n, splits, r, dtype=torch.float32, device=dev)
        part_lse = call.empty(n_tok, n, splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_lse = latent  # unused
        if work_list:  # static bounds, one split: no program writes the padded tokens' rows (a merge would)
            latent.zero_()
    ptrs, scalars, rptrs, red = args(part_acc, part_lse)
    attn.launch(plan.grid, ptrs, scalars)
    if plan.reduce is not None:
        plan.reduce.launch((n_tok, n), rptrs, red)
    return splits


def _gluon_decode_choice(call: _Call, cfg, dims: MLADims, q_dtype: torch.dtype, mla_cache: torch.Tensor,
                         dev: torch.device, scaled: bool) -> bool:
    """Whether this step's decode runs on the Gluon kernels (TritonPolicy.decode_kernel). "auto": where
    gluon_decode.supports accepts the dims and device and either the `tl` decode would run heads-on-N
    or N > 32 (the many-heads Gluon kernel: 1.2-3.0x faster than the `tl` kernel on all 24 measured
    N 64 / 128 shapes, docs/benchmarks/decode_gluon_wide.md); "gluon" raises where it cannot serve them."""
    want = call.policy.decode_kernel
    if want == "triton":
        return False
    if interpreting():
        ok, why = False, "the Triton interpreter (TRITON_INTERPRET=1) does not run Gluon kernels"
    else:
        ok, why = GD.supports(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, mla_cache.shape[1], q_dtype,
                              mla_cache.dtype, dev)
    if ok and scaled:
        ok, why = False, "the Gluon decode kernel does not apply cache scales"
    if want == "gluon" and not ok:
        raise MLAShapeError(f"TritonPolicy(decode_kernel='gluon') cannot run this decode: {why}. "
                            "Use decode_kernel='auto' or 'triton'.")
    return ok and (want == "gluon" or cfg.heads_on_n or dims.num_heads > GD.NARROW_MAX_HEADS)


@dataclass(frozen=True)
class _GluonDecodeLaunch:
    """The Gluon decode of a step, planned once for every layer: the kernel variant, its split merge,
    grid, split count and minimum chunk; `q_heads` > 0: the many-heads kernel, which reads the latent
    queries through a TMA descriptor with boxes of that many heads."""

    attn: BoundKernel
    reduce: Optional[BoundKernel]
    grid: tuple[int, int, int]
    splits: int
    chunk: int
    q_heads: int = 0
    #: heads per program of the split merge (> 1: split_reduce_heads_kernel)
    reduce_heads: int = 1


def _plan_gluon_decode(call: _Call, dims: MLADims, page_size: int, n_seqs: int, kv_bound: int,
                       dev: torch.device) -> _GluonDecodeLaunch:
    """Config and split count from `gluon_decode.plan` (the wave model, as for the `tl` heads-on-N
    kernel), bound kernels for the step's layers."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    gcfg, splits = GD.plan(n, r, dr, n_seqs, kv_bound, call.policy.decode_splits, dev)
    chunk = -(-min_chunk(dev) // GD.BLOCK_N) * GD.BLOCK_N
    split = splits > 1
    attn = call.bound(GD.kernel_for(gcfg), GD.kernel_meta(n, r, dr, page_size, gcfg, split))
    heads = _reduce_heads(n, r, n_seqs, splits) if gcfg.wide else 1
    reduce = None
    if split:
        reduce = call.bound(K.split_reduce_kernel, _reduce_meta(r)) if heads == 1 else \
            call.bound(K.split_reduce_heads_kernel, _reduce_heads_meta(r, heads))
    return _GluonDecodeLaunch(attn, reduce, GD.grid(n, n_seqs, splits, gcfg), splits, chunk,
                              gcfg.cols if gcfg.wide else 0, heads)


#: split_reduce_heads_kernel's heads per program
REDUCE_HEADS = 4


def _reduce_heads(n: int, r: int, n_seqs: int, splits: int) -> int:
    """Heads per program of the many-heads decode's split merge: REDUCE_HEADS where the merge has many
    (token, head) rows and few splits, else 1 (split_reduce_kernel). Measured on an H200 (merge after
    the decode, CUDA graph): N 128 batch 32 two splits 49.8 vs 51.6 us, N 64 batch 32 four splits
    41.8 vs 42.0; with 8+ splits or batch <= 8 the one-head merge is faster (batch 8, 8 splits: 50.0
    vs 48.8 us)."""
    ok = _reduce_heads_serves(n, r) and splits <= 4 and n_seqs * n >= 2048
    return REDUCE_HEADS if ok else 1


def _reduce_heads_serves(n: int, r: int) -> bool:
    """Whether split_reduce_heads_kernel can merge these dims (whole head blocks, R a power of two)."""
    return n % REDUCE_HEADS == 0 and r & (r - 1) == 0


def _reduce_heads_meta(r: int, heads: int) -> dict[str, Any]:
    return dict(R=r, BLOCK_H=heads, num_warps=4)


def _warm_gluon_decode(call: _Call, descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, dims: MLADims,
                       page_size: int, common: dict[str, Any], q_desc=None) -> None:
    """Compile and load every Gluon decode variant this layer may launch (SPLIT or not, each
    candidate config) and the split merge, without launching them."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    dummy_acc = torch.empty(1, n, 2, r, dtype=torch.float32, device=dev)
    dummy_lse = torch.empty(1, n, 2, dtype=torch.float32, device=dev)
    for split in (False, True):
        pa, pl = (dummy_acc, dummy_lse) if split else (latent, latent)
        for gcfg in GD.candidate_configs(n, r, dr):  # a graph of another batch size may pick the other
            ptrs, scalars = GD.kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, pa, pl,
                                           split=split, q_desc=q_desc if gcfg.wide else None, **common)
            call.bound(GD.kernel_for(gcfg), GD.kernel_meta(n, r, dr, page_size, gcfg, split)).warmup(ptrs, scalars)
        if split:
            rest = (common["tok_base"], common["abs_base"], 2, *pa.stride()[:3], *pl.stride()[:2], latent.stride(0),
                    latent.stride(1))
            call.bound(K.split_reduce_kernel, _reduce_meta(r)).warmup((pa, pl, latent, cu_seqlen), rest)
            # The several-heads merge too, wherever some batch size of these dims would pick it.
            if any(c.wide for c in GD.candidate_configs(n, r, dr)) and _reduce_heads_serves(n, r):
                call.bound(K.split_reduce_heads_kernel, _reduce_heads_meta(r, REDUCE_HEADS)).warmup(
                    (pa, pl, latent), rest)


def _launch_gluon_decode(call: _Call, q_abs, q_pe, mla_cache, page_table, cu_seqlen, seq_len, latent, *, seq_base,
                         n_seqs, tok_base, abs_base, kv_bound, dims: MLADims, qk_scale: float) -> int:
    """The decode sequences [seq_base, seq_base + n_seqs) on gluon_decode_kernel (+ the split merge).
    Returns the split count, or 0 (nothing launched) where this layer's cache rows are not 16-byte
    aligned for TMA."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    key = ("gluon", mla_cache.data_ptr(), tuple(mla_cache.shape), mla_cache.dtype)
    descs = _per_model(call.descriptors, key, lambda: GD.cache_descriptors(mla_cache, r, dr), call.memo_limit)
    if descs is None:
        return 0
    page_size = mla_cache.shape[1]
    wkey = ("gluon", dims, q_abs.dtype, mla_cache.dtype, page_size, dev)
    if call.warmed is not None and ("gluon failed",) + wkey in call.warmed:
        return 0
    plan = call.plan(("gluon_decode", dims, q_abs.dtype, page_size, n_seqs, kv_bound),
                     lambda: _plan_gluon_decode(call, dims, page_size, n_seqs, kv_bound, dev))
    common = dict(seq_base=seq_base, tok_base=tok_base, abs_base=abs_base, chunk=plan.chunk, qk_scale=qk_scale)
    q_desc = None
    if plan.q_heads:
        q_desc = GD.query_descriptor(q_abs, plan.q_heads)
        if q_desc is None:
            return 0
    if not _capturing_on(dev) and (call.warmed is None or wkey not in call.warmed):
        # Every variant (SPLIT or not, each candidate config) loaded eagerly: a decode graph captured
        # later plans its splits from the static capacity and its config from its batch size, and may
        # need another one (no module loads while capturing).
        try:
            _warm_gluon_decode(call, descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, dims, page_size,
                               common, q_desc)
        except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build the kernel
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            if call.policy.decode_kernel == "gluon":
                raise MLAShapeError(f"TritonPolicy(decode_kernel='gluon'): the Gluon decode kernel did not compile "
                                    f"with triton {triton.__version__} ({why}). It was verified with triton 3.6; "
                                    "use decode_kernel='auto' or 'triton'.") from e
            warnings.warn(f"Gluon decode kernel did not compile with triton {triton.__version__} ({why}); this "
                          "model decodes on the tl kernels (TritonPolicy.decode_kernel='triton' silences this).",
                          RuntimeWarning, stacklevel=2)
            if call.warmed is not None:
                call.warmed.add(("gluon failed",) + wkey)
            return 0
        if call.warmed is not None:
            call.warmed.add(wkey)
    split = plan.splits > 1
    if split:
        part_acc = call.empty(n_seqs, n, plan.splits, r, dtype=torch.float32, device=dev)
        part_lse = call.empty(n_seqs, n, plan.splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_lse = latent  # unused
    ptrs, scalars = GD.kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse,
                                   split=split, q_desc=q_desc, **common)
    plan.attn.launch(plan.grid, ptrs, scalars)
    if plan.reduce is not None:
        rest = (tok_base, abs_base, plan.splits, *part_acc.stride()[:3], *part_lse.stride()[:2], latent.stride(0),
                latent.stride(1))
        if plan.reduce_heads > 1:
            plan.reduce.launch((n_seqs, n // plan.reduce_heads), (part_acc, part_lse, latent), rest)
        else:
            plan.reduce.launch((n_seqs, n), (part_acc, part_lse, latent, cu_seqlen), rest)
    return plan.splits


def _per_model(table: Optional[dict[tuple[Any, ...], Any]], key: tuple[Any, ...], make: Any, limit: int) -> Any:
    """`make()` remembered in a session table for the model's life. The entries hold references to
    the model's tensors (caches, weights): a table is cleared when it outgrows `limit` (about two
    entries per layer), so replaced tensors are never kept alive for long."""
    if table is None:
        return make()
    got = table.get(key)
    if got is None:
        if len(table) >= limit:
            table.clear()
        got = table[key] = make()
    return got


def _cache_descriptors(call: _Call, mla_cache: torch.Tensor, cfg, block_c: int, dr: int):
    """The heads-on-N TMA descriptors of one layer's cache, built once per cache (they hold no step data)."""
    key = (mla_cache.data_ptr(), tuple(mla_cache.shape), mla_cache.dtype, cfg.block_n, block_c, dr)
    return _per_model(call.descriptors, key, lambda: _heads_on_n_descriptors(
        mla_cache.view(-1, mla_cache.shape[-1]), cfg.block_n, block_c, dr), call.memo_limit)


@dataclass(frozen=True)
class _ExpandLaunch:
    """The expanded prefill of a step, planned once for every layer of the same kind: tiles and the
    bound gather / attention kernels (TMA and pointer variants: TMA needs the step's fresh K/V
    buffers 16-byte aligned, which each call checks)."""

    block_m: int
    block_n: int
    dn1: int
    dn2: int
    tma: bool
    gather: BoundKernel
    expand_tma: BoundKernel
    expand_ptr: BoundKernel


def _plan_expanded(call: _Call, dims: MLADims, dtype: torch.dtype, mla_cache: torch.Tensor, scaled: bool, n_pre: int,
                   max_q: int, dev: torch.device) -> _ExpandLaunch:
    n, dn, dv, r, dr = (dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank,
                        dims.qk_rope_head_dim)
    cfg = expand_config(dims, dtype, triton.cdiv(max_q, 128) * n * n_pre, tuning.num_sms(dev))
    dn1, dn2 = nope_chunks(dn, cfg.split_nope)
    w = r + dr
    gather = call.bound(K.gather_kv_kernel, dict(W=w, R=r, PAGE_SIZE=mla_cache.shape[1], BLOCK_T=GATHER_BLOCK_T,
                                                 BLOCK_W=min(256, pow2(w)), SCALED=scaled, num_warps=4))
    meta = dict(DN=dn, DV=dv, DR=dr, R=r, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_DN=dn1, BLOCK_DN2=dn2, BLOCK_DV=pow2(dv), BLOCK_DR=pow2(dr),
                DOT_PREC=dot_precision(dtype), HEAVY_FIRST=cfg.heavy_first,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tma = cfg.tma and not (dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (9, 0))
    return _ExpandLaunch(cfg.block_m, cfg.block_n, dn1, dn2, tma, gather,
                         call.bound(K.expanded_prefill_kernel, {**meta, "USE_TMA": True}),
                         call.bound(K.expanded_prefill_kernel, {**meta, "USE_TMA": False}))


GATHER_BLOCK_T = 32


def _fa3_for_step(call: _Call, step: StepShape, dev: torch.device) -> bool:
    """Whether this step's expanded prefill attends with FlashInfer's FA3 (the session has one, the step
    runs eagerly, and under "auto" its longest prefill is long enough and the FA3 module is compiled
    already: a step never waits for nvcc unless "flashinfer" is forced)."""
    if call.fa3 is None or not step.qo_indptr or _capturing_on(dev):
        return False
    if call.policy.prefill_attention == "flashinfer":
        return True
    return step.max_q >= tuning.FA3_PREFILL_MIN_TOKENS and call.fa3.ready


def _prefill_expanded(call: _Call, q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos,
                      seq_len, out, *, n_pre, max_q, max_kv, total_kv, dims, qk_scale, scales: CacheScales = UNIT_SCALES,
                      fa3: Optional[Fa3Prefill] = None, step: Optional[StepShape] = None):
    n, dv, r, dr = dims.num_heads, dims.v_head_dim, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_nope.device
    scaled = _scaled(mla_cache, scales)
    plan = call.plan(("expand", dims, q_nope.dtype, mla_cache.dtype, mla_cache.shape[1], scaled, n_pre, max_q),
                     lambda: _plan_expanded(call, dims, q_nope.dtype, mla_cache, scaled, n_pre, max_q, dev))
    kv_cu = call.plan(("kv_cu", n_pre, dev), lambda: _kv_offsets(seq_len, n_pre, dev))  # once per step
    lat = call.empty(total_kv, r + dr, dtype=q_nope.dtype, device=dev)  # an FP8 cache is dequantised here
    plan.gather.launch((triton.cdiv(max_kv, GATHER_BLOCK_T), n_pre), (mla_cache, page_table, seq_len, kv_cu, lat),
                       (scales.latent, scales.rope, mla_cache.stride(1), page_table.stride(0), lat.stride(0)))
    kv = torch.matmul(lat[:, :r], kv_b_proj_weight.t())  # [total_kv, N*(Dn+Dv)]: K_nope | V per head
    if fa3 is not None and step is not None:
        _attend_fa3(call, fa3, step, q_nope, q_pe, kv, lat, out, dims, qk_scale)
        return
    descs = _kv_descriptors(kv, lat, plan.block_n, plan.dn1, plan.dn2, pow2(dv), pow2(dr) if dr else 0) \
        if plan.tma else None
    expand = plan.expand_ptr if descs is None else plan.expand_tma
    expand.launch((triton.cdiv(max_q, plan.block_m), n, n_pre),
                  (q_nope, q_pe, kv, lat, cu_seqlen, input_pos, kv_cu, out, *(descs or (None,) * 4)),
                  (qk_scale, q_nope.stride(1), q_nope.stride(2), q_pe.stride(1), q_pe.stride(2),
                   kv.stride(0), lat.stride(0), out.stride(1), out.stride(2)))


#: rows (token, one head) per program of pack_heads_kernel: a [32, pow2(D)] tile
PACK_BLOCK_T = 32


def _attend_fa3(call: _Call, fa3: Fa3Prefill, step: StepShape, q_nope, q_pe, kv, lat, out, dims: MLADims,
                qk_scale: float) -> None:
    """The expanded prefill's attention by FlashInfer's FA3: K per head [k_nope | k_pe] and q [q_nope |
    q_pe] written by one kernel each (pack_heads_kernel; was four torch copies, ~35 µs at N 16 x 2048
    tokens on an H200), V a strided view of the expansion GEMM's output, the output straight into
    `out`'s prefill rows."""
    n, dn, dr, dv, r = (dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim,
                        dims.kv_lora_rank)
    t, total_kv = step.n_pre_tok, kv.shape[0]
    kv3 = kv.view(total_kv, n, dn + dv)
    k = call.empty(total_kv, n, dn + dr, dtype=kv.dtype, device=kv.device)
    q = call.empty(t, n, dn + dr, dtype=q_nope.dtype, device=q_nope.device)
    pack = call.plan(("fa3_pack", dn, dr), lambda: call.bound(K.pack_heads_kernel, dict(
        DA=dn, DB=dr, BLOCK_T=PACK_BLOCK_T, BLOCK_DA=pow2(dn), BLOCK_DB=pow2(dr), num_warps=4)))
    k_pe = lat[:, r:] if dr else lat  # (unused when Dr = 0)
    pack.launch((triton.cdiv(total_kv, PACK_BLOCK_T), n), (kv3, k_pe, k),
                (total_kv, kv3.stride(0), kv3.stride(1), lat.stride(0), 0, k.stride(0), k.stride(1)))
    qn, qp = q_nope[0], q_pe[0]
    pack.launch((triton.cdiv(t, PACK_BLOCK_T), n), (qn, qp, q),
                (t, qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), q.stride(0), q.stride(1)))
    fa3.run(q, k, kv3[..., dn:], out[0, :t], step.qo_indptr, step.kv_indptr, qk_scale / LOG2E)


def _kv_offsets(seq_len: torch.Tensor, n_pre: int, dev: torch.device) -> torch.Tensor:
    """[0, kv_0, kv_0 + kv_1, ...] of the prefill sequences, on the device (no sync): where each
    sequence's rows start in the expanded K/V buffers. The same for every layer of a step."""
    kv_cu = torch.zeros(n_pre + 1, dtype=torch.int32, device=dev)
    torch.cumsum(seq_len[:n_pre], 0, dtype=torch.int32, out=kv_cu[1:])
    return kv_cu


def _kv_descriptors(kv: torch.Tensor, lat: torch.Tensor, bn: int, dn1: int, dn2: int, dv: int, dr: int):
    """Tensor descriptors of the expanded K_nope (one or two chunks), V and k_pe tiles, or None where
    TMA cannot take the buffers (rows must be 16-byte aligned). The device (SM90+ or the interpreter)
    was checked by the launch plan."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if any((t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16 for t in (kv, lat)):
        return None
    return (TensorDescriptor.from_tensor(kv, [bn, dn1]), TensorDescriptor.from_tensor(kv, [bn, dn2]) if dn2 else None,
            TensorDescriptor.from_tensor(kv, [bn, dv]), TensorDescriptor.from_tensor(lat, [bn, dr]) if dr else None)


# ----------------------------------------------------------------------------- the op
def _decode_config(call: _Call, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype):
    """decode_config under the policy: FP8_DOT runs on the head-rows kernel only."""
    layout = "heads_on_m" if (call.policy.fp8_dot and is_fp8(cache_dtype)) else call.policy.decode_layout
    return decode_config(dims, dtype, cache_dtype, layout)


def _absorb_config(call: _Call, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, max_q: int):
    """Config of the absorbed prefill part, which is also where multi-token decode lands (every
    sequence's few new tokens on a cached history: speculative-decoding verification; the cost rule
    keeps such chunks absorbed). Up to MULTI_TOKEN_MAX_Q new tokens per sequence, where decode runs
    heads-on-N: that kernel with query columns (multi_token_config); H200, bf16: 1.2-2.0x faster
    than the rows on 16 of 16 shapes of N 16/20/32/128 (docs/benchmarks/multi_token.md). Otherwise
    (longer chunks, N 33-64, an FP8 cache — columns measured in bf16 only — or
    decode_layout="heads_on_m"): absorb_prefill_config, 64 rows of query tokens x heads."""
    if max_q <= MULTI_TOKEN_MAX_Q and heads_on_n_supported(dims) and \
            (call.policy.decode_layout == "heads_on_n" or (call.policy.decode_layout == "auto" and not is_fp8(cache_dtype))):
        dec = _decode_config(call, dims, dtype, cache_dtype)
        if dec.heads_on_n:
            return multi_token_config(dec, max_q, dims.kv_lora_rank)
    return absorb_prefill_config(dims, dtype)


def _current_call(meta: Mapping[str, torch.Tensor]) -> tuple[_Call, StepShape]:
    """The call context and the step's host shape. With a session whose `prepare` saw this step
    (its batch counts and, with prefill sequences, their cached prefix match the host metadata), both
    come from the session and the step's plans are shared by all layers; otherwise they are made for
    this call alone. The contract is FlashInfer's: the runner prepares every step before the graph;
    the checks keep a call made without it from running on another step's sizes."""
    bi = meta["batch_info_host"].tolist()  # host mirrors (CPU tensors): no device sync
    ms = meta["max_seq_info_host"].tolist()
    sess = active_session("triton")
    if isinstance(sess, TritonMLASession):
        step = sess.step
        if step is not None and step.key == (bi[0], bi[1], bi[2], ms[0], ms[1]) and \
                (step.n_pre == 0 or int(meta["input_pos_host"][: step.n_pre].numpy().sum()) == step.prefix):
            return sess.call, step
        call = replace(sess.call, plans=None)
    else:
        call = _Call(DEFAULT_POLICY)
    return call, StepShape.from_host(meta["batch_info_host"], meta["max_seq_info_host"], meta["cu_seqlen_host"],
                                     meta["input_pos_host"])


def _absorb_weights(call: _Call, dims: MLADims, kv_b_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_kn, W_v) views of a layer's kv_b_proj weight, made once per weight when there is a session."""
    key = (kv_b_proj_weight.data_ptr(), kv_b_proj_weight.shape, kv_b_proj_weight.dtype, dims)
    return _per_model(call.views, key, lambda: dims.split_kv_b(kv_b_proj_weight), call.memo_limit)


def _triton_mla_with_cache(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                           scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's tokens to the paged cache (quantised when it is FP8), then attend. Returns [1, T, N, Dv]."""
    dims = check_cached_inputs(OP, x, mla_cache)
    if not HAS_TRITON:
        raise RuntimeError(f"{OP}: triton is not installed ({_TRITON_IMPORT_ERROR}); "
                           "install triton>=3.4 or pick another MLA backend (e.g. 'torch').")
    why = validate_dims(dims, x.q_nope.dtype)
    if why:
        raise MLAShapeError(f"{OP}: {why}. The descriptor's check() refuses these dims; use another backend.")
    call, step = _current_call(meta)
    prefill_mode = call.policy.prefill_mode
    if prefill_mode == "expand" and not expansion_supported(dims):
        raise MLAShapeError(f"{OP}: prefill_mode='expand' needs Dn, Dv <= {MAX_EXPAND_HEAD_DIM}, got "
                            f"Dn={dims.qk_nope_head_dim}, Dv={dims.v_head_dim}; use 'auto' or 'absorb'.")
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight = x
    if compressed_kv.stride(-1) != 1 or kpe.stride(-1) != 1 or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        for name, t in (("compressed_kv", compressed_kv), ("kpe", kpe), ("q_nope", q_nope), ("q_pe", q_pe)):
            if t.stride(-1) != 1:
                raise MLAShapeError(f"{OP}: {name} must have a unit stride in its last dim, got strides {t.stride()}.")
    if not mla_cache.is_contiguous():
        raise MLAShapeError(f"{OP}: mla_cache must be contiguous [num_pages, page_size, R+Dr].")
    page_table, cu_seqlen, input_pos = meta["page_table"], meta["cu_seqlen"], meta["input_pos"]
    seq_len_with_cache = meta["seq_len_with_cache"]

    if step.static:
        return _attend_static(call, x, meta, mla_cache, dims, resolve_scale(dims, scale) * LOG2E, scales)
    n, dv = dims.num_heads, dims.v_head_dim
    t_all = q_nope.shape[1]
    dev = q_nope.device
    out = call.empty(1, t_all, n, dv, dtype=q_nope.dtype, device=dev)
    n_pre, n_pre_tok, n_dec, max_q, max_kv = step.key
    num_tok = step.num_tok
    if num_tok < t_all:
        out[:, num_tok:].zero_()  # padded tokens: finite
    if num_tok == 0:
        return out

    _launch_append(compressed_kv, kpe, mla_cache, meta["cache_loc"], num_tok, dims, scales, call)
    qk_scale = resolve_scale(dims, scale) * LOG2E

    mode = None
    total_kv = 0
    if n_pre > 0:
        total_kv = n_pre_tok + step.prefix
        mode = choose_prefill_path(dims, n_pre_tok, step.prefix, step.pairs) if prefill_mode == "auto" \
            else prefill_mode

    abs_lo = 0 if mode == "absorb" else n_pre_tok
    if abs_lo < num_tok:
        w_kn, w_v = _absorb_weights(call, dims, kv_b_proj_weight)
        q_abs = torch.bmm(q_nope[0, abs_lo:num_tok].transpose(0, 1), w_kn)  # [N, Ta, R]
        latent = call.empty(*q_abs.shape, dtype=q_abs.dtype, device=dev)
        q_in, qpe_in, q_scale = q_abs, q_pe, None
        if is_fp8(mla_cache.dtype) and call.policy.fp8_dot:
            q_in, qpe_in, q_scale = quantize_queries(q_abs, q_pe[:, :num_tok])
        if mode == "absorb":
            _launch_absorbed(
                call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                seq_base=0, n_seqs=n_pre, tok_base=0, n_tok=n_pre_tok, abs_base=abs_lo, max_q=max_q,
                kv_bound=max_kv, dims=dims, qk_scale=qk_scale,
                cfg=call.plan(("absorb_cfg", dims, q_nope.dtype, mla_cache.dtype, max_q),
                              lambda: _absorb_config(call, dims, q_nope.dtype, mla_cache.dtype, max_q)),
                scales=scales, q_scale=q_scale,
            )
        if n_dec > 0:
            # Decode grid: from host batch_info (fixed per captured graph) and, under CUDA-graph
            # capture, a split count from the static cache capacity (page-table width), so a replay
            # stays correct while sequences grow; kernels skip chunks past each sequence's length.
            static_kv = page_table.shape[1] * mla_cache.shape[1]
            kv_bound = static_kv if _capturing_on(dev) else min(max_kv, static_kv)
            cfg = call.plan(("decode_cfg", dims, q_nope.dtype, mla_cache.dtype),
                            lambda: _decode_config(call, dims, q_nope.dtype, mla_cache.dtype))
            use_gluon = q_scale is None and call.plan(
                ("gluon_choice", dims, q_in.dtype, mla_cache.dtype, mla_cache.shape[1]),
                lambda: _gluon_decode_choice(call, cfg, dims, q_in.dtype, mla_cache, dev,
                                             _scaled(mla_cache, scales)))
            if not (use_gluon and _launch_gluon_decode(
                    call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, seq_len_with_cache, latent,
                    seq_base=n_pre, n_seqs=n_dec, tok_base=n_pre_tok, abs_base=abs_lo, kv_bound=kv_bound,
                    dims=dims, qk_scale=qk_scale)):
                _launch_absorbed(
                    call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                    seq_base=n_pre, n_seqs=n_dec, tok_base=n_pre_tok, n_tok=n_dec, abs_base=abs_lo, max_q=1,
                    kv_bound=kv_bound, cfg=cfg, dims=dims, qk_scale=qk_scale, scales=scales, q_scale=q_scale,
                )
        # latent . W_v^T written straight into out's rows ([N, Ta, Dv] view, row stride N*Dv): no copy
        torch.bmm(latent, w_v.transpose(1, 2), out=out[0, abs_lo:num_tok].transpose(0, 1))
    if mode == "expand":
        fa3 = call.fa3 if _fa3_for_step(call, step, dev) else None
        _prefill_expanded(
            call, q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos, seq_len_with_cache,
            out, n_pre=n_pre, max_q=max_q, max_kv=max_kv, total_kv=total_kv, dims=dims, qk_scale=qk_scale,
            scales=scales, fa3=fa3, step=step,
        )
    return out


#: Cap on the fp32 split partials of one static-bounds call ([T, N, splits, R]): a captured graph
#: keeps them in its memory pool.
STATIC_PARTIAL_BYTES = 64 << 20


def _attend_static(call: _Call, x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                   dims: MLADims, qk_scale: float, scales: CacheScales) -> torch.Tensor:
    """The op for a step captured once per token count and replayed for any batch of that size
    (mixed prefill + decode steps): no launch reads a host count. Every one of the T tokens is
    appended (padded tokens go to the scratch page) and attended on the absorbed path (no expansion:
    its history buffer is sized by the cached prefix) by one launch whose programs find their
    (sequence, query block) in the device cu_seqlen (kernels._work_item) over the sequence
    capacity; the split count comes from the cache capacity (page-table width), as in decode
    graphs. Padded tokens get a zero output. Returns [1, T, N, Dv]."""
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight = x
    page_table, cu_seqlen = meta["page_table"], meta["cu_seqlen"]
    n, r, dv = dims.num_heads, dims.kv_lora_rank, dims.v_head_dim
    t_all = q_nope.shape[1]
    b_cap = cu_seqlen.shape[0] - 1
    dev = q_nope.device
    out = call.empty(1, t_all, n, dv, dtype=q_nope.dtype, device=dev)
    _launch_append(compressed_kv, kpe, mla_cache, meta["cache_loc"], t_all, dims, scales, call)
    w_kn, w_v = _absorb_weights(call, dims, kv_b_proj_weight)
    q_abs = torch.bmm(q_nope[0].transpose(0, 1), w_kn)  # [N, T, R]
    latent = call.empty(*q_abs.shape, dtype=q_abs.dtype, device=dev)
    q_in, qpe_in, q_scale = q_abs, q_pe, None
    if is_fp8(mla_cache.dtype) and call.policy.fp8_dot:
        q_in, qpe_in, q_scale = quantize_queries(q_abs, q_pe)
    # Per-sequence query counts are not known here: the heads-on-N kernel with multi-token query
    # columns where decode runs heads-on-N (decode and spec-verify items fill few columns; prefill
    # items take BLOCK_Q queries each), else the rows of the absorbed prefill.
    q_cols = min(t_all, MULTI_TOKEN_MAX_Q)
    cfg = call.plan(("absorb_cfg", dims, q_nope.dtype, mla_cache.dtype, q_cols),
                    lambda: _absorb_config(call, dims, q_nope.dtype, mla_cache.dtype, q_cols))
    max_splits = max(1, STATIC_PARTIAL_BYTES // (t_all * n * r * 4))
    _launch_absorbed(
        call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, meta["input_pos"], meta["seq_len_with_cache"], latent,
        seq_base=0, n_seqs=b_cap, tok_base=0, n_tok=t_all, abs_base=0, max_q=t_all,
        kv_bound=page_table.shape[1] * mla_cache.shape[1], cfg=cfg, dims=dims, qk_scale=qk_scale, scales=scales,
        q_scale=q_scale, work_list=b_cap, max_splits=max_splits,
    )
    torch.bmm(latent, w_v.transpose(1, 2), out=out[0].transpose(0, 1))
    return out


#: the op, and its implementation that the piecewise runner calls directly for eager attention pieces
triton_mla_with_cache, triton_mla_with_cache_direct = define_cached_op_and_kernel(OP, METADATA, _triton_mla_with_cache)


# ----------------------------------------------------------------------------- descriptor
@register_backend
class TritonMLABackend(MLABackend):
    name = "triton"
    cached_op = triton_mla_with_cache
    direct_call = staticmethod(triton_mla_with_cache_direct)
    metadata = METADATA
    source = "autodeploy_mla Triton kernels (docs/triton_backend.md; H200 numbers in docs/benchmarks/mla_kernels.md)"
    # Decode grids come from host batch_info (fixed per captured batch size) and a split count from
    # the static page-table width under capture; kernels read lengths from device metadata.
    # Verified by tests/test_triton_mla.py::test_cuda_graph_decode_replays_as_sequences_grow (GPU).
    decode_graph_safe = True
    #: static-bounds steps run `_attend_static` (one work-list launch over the sequence capacity)
    mixed_graph_safe = True
    #: sparse MLA (DSA) ops: split points too; graph safe like the dense op (static sizes under capture)
    dynamic_ops = (triton_mla_sparse_with_cache, SPARSE_INDEXER_WITH_CACHE)

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        device = target.device
        tv = target.versions.get("triton")
        if tv is None or not HAS_TRITON:
            extra = f" (import failed: {_TRITON_IMPORT_ERROR})" if tv is not None else ""
            return CheckResult(False, f"triton not installed{extra}; pip install 'triton>=3.4'")
        if (parse_version(tv) or (0, 0, 0)) < (3, 4, 0):
            return CheckResult(False, f"triton {tv} is older than 3.4 (the version these kernels were tested on)")
        if device.type == "cpu":
            if not interpreting():
                return CheckResult(False, "Triton kernels need a CUDA GPU (on CPU only through TRITON_INTERPRET=1)")
        elif device.type != "cuda":
            return CheckResult(False, f"device type {device.type!r} unsupported (CUDA only)")
        elif device.sm is not None and device.sm < 80 and dtype == torch.bfloat16:
            return CheckResult(False, f"bf16 tl.dot needs SM80+, device is {device.short()}")
        elif device.sm is not None and device.sm < 70:
            return CheckResult(False, f"needs SM70+, device is {device.short()}")
        if target.page_size < 1:
            return CheckResult(False, f"page_size={target.page_size} must be >= 1")
        why = validate_dims(dims, dtype)
        if why:
            return CheckResult(False, why)
        note = "" if expansion_supported(dims) else f"; prefill absorbed only (Dn/Dv > {MAX_EXPAND_HEAD_DIM})"
        where = "CPU interpreter (slow, for tests)" if device.type == "cpu" else device.short()
        if device.type == "cuda":
            g_ok, g_why = GD.dims_supported(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim,
                                            target.page_size, dtype, device.sm)
            wide = dims.num_heads > GD.NARROW_MAX_HEADS
            note += ((f"; decode on the Gluon warp-specialised kernel{', 64 heads per program' if wide else ''} "
                      "(16-bit cache)") if g_ok else f"; decode on the tl kernels (not Gluon: {g_why})")
        return CheckResult(True, f"triton on {where}: any N, R<= {MAX_KV_LORA_RANK}, Dr<= {MAX_ROPE_DIM}{note}")

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        if cache_dtype == dtype:
            return CheckResult(True, "cache in the model dtype")
        if not is_fp8(cache_dtype):
            return CheckResult(False, f"a {cache_dtype_name(cache_dtype)} cache under {cache_dtype_name(dtype)} "
                                      "activations (the kernels read the model dtype or fp8_e4m3)")
        sm = target.device.sm
        if target.device.type == "cuda" and sm is not None and sm < 89:
            return CheckResult(False, f"Triton converts e4m3 only on SM89+, device is {target.device.short()}")
        return CheckResult(True, "fp8_e4m3 cache: tiles converted to the query dtype on load, scales in the scores")

    def setup(self, spec: SessionSpec, policy: Optional[TritonPolicy] = None) -> TritonMLASession:
        self.check_all(spec)
        return TritonMLASession(spec, policy or DEFAULT_POLICY)
