"""Capability facts of the FlashInfer MLA kernels, kept as data (DESIGN §8).

Every record says what one kernel family accepts for one range of FlashInfer versions, and where
that fact comes from. The descriptors' `check()` functions only *read* these records: to support a
new FlashInfer release or a new shape, add or widen a record here (with its source) — never edit a
check function. Anything not covered by a record is refused, because a kernel launched on an
unsupported shape may not raise at all: FlashInfer 0.6.18.post1 with R=256 crashed with an illegal
memory access on H200 (DESIGN §8), which poisons the whole CUDA context.

Sources cited by the records:

- ``DESIGN8``: the capability table and the measurements in DESIGN §8/§12 (H200, 2026-11-21).
- ``FI_0618_SRC``: the FlashInfer 0.6.18.post1 wheel itself (``flashinfer/mla/_core.py``:
  ``BatchMLAPagedAttentionWrapper``, ``_check_trtllm_gen_mla_shape``,
  ``trtllm_batch_decode_with_kv_cache_mla``; ``data/include/flashinfer/attention/scheduler.cuh``:
  ``MLAPlan``; ``mla_hopper.cuh``: the causal KV bound).
- ``FI_MAIN_SRC``: FlashInfer's newer planning code (``mla/_batch_mla/_backends/_fa_common.py``,
  read through the code search of this workplace), which validates what 0.6.x left unchecked:
  fa3 R ∈ {128, 256, 512}, fa2 R % 128 == 0, Dr % 64 == 0 (0 allowed), a shared-memory bound, a
  16384-work-item plan capacity and a causal tile-boundary defect.
- ``FI_TESTS``: FlashInfer's ``tests/attention/test_deepseek_mla.py`` (page sizes 1, 16, 32 with the
  MLA wrapper, heads 4/16/32/64/128, NaN in the out-of-bounds tail of the last page).
- ``H200_RUN``: this project's own GPU tests (docs/flashinfer_backends.md, docs/benchmarks/).
- ``FI_072_SRC``: the FlashInfer 0.7.2.post1 wheel (``mla/_batch_mla/_backends/_fa_common.py``: an
  FP8 KV cache needs SM90, bf16 queries, head_dim_ckv 512, head_dim_kpe 0 or 64 and per-tensor
  ``ckv_scale`` / ``kpe_scale`` at run; ``trtllm_gen_backend.py``: TRT-LLM-gen needs query and KV of
  one dtype, bf16 or e4m3; ``mla/_core.py``: tensor ``bmm1_scale`` / ``bmm2_scale`` on trtllm-gen).

FP8 caches have their own records (`CACHE_FACTS`): which kernel reads an e4m3 cache, for which
dims, and with which query dtype; `check_cache_against_facts` refuses anything they do not cover.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch

from ..attention.registry import CheckResult, DeviceInfo, Target, parse_version
from ..attention.cache_format import cache_dtype_name
from ..attention.mla_dims import MLADims

Version = tuple[int, int, int]

SOURCES: Mapping[str, str] = MappingProxyType({
    "DESIGN8": "DESIGN §8 capability table + §12 H200 measurements (2026-11-21)",
    "FI_0618_SRC": "FlashInfer 0.6.18.post1 wheel source (mla/_core.py, scheduler.cuh MLAPlan, mla_hopper.cuh)",
    "FI_MAIN_SRC": "FlashInfer newer planner source (mla/_batch_mla/_backends/_fa_common.py: _validate_generated_fa_plan, "
    "_fa_plan_work_count, _validate_fa_causal_tile_bound)",
    "FI_TESTS": "FlashInfer tests/attention/test_deepseek_mla.py",
    "H200_RUN": "this project's H200 runs (docs/flashinfer_backends.md)",
    "FI_072_SRC": "FlashInfer 0.7.2.post1 wheel source (mla/_batch_mla/_backends/_fa_common.py FP8 rules, "
    "_wrapper.py run(ckv_scale, kpe_scale), trtllm_gen_backend.py dtype rule, mla/_core.py bmm scales)",
})


@dataclass(frozen=True)
class KernelFacts:
    """What one FlashInfer kernel family accepts for FlashInfer versions in [min_version, max_version)."""

    backend: str  # descriptor name: "flashinfer_mla" | "flashinfer_mla_sparse" | "flashinfer_trtllm_mla"
    kernel: str  # "fa3" | "fa2" | "trtllm-gen"
    min_version: Version
    max_version: Version  # exclusive
    sms: frozenset[int]  # compute capabilities (major*10+minor) the kernel is accepted on
    dtypes: frozenset[torch.dtype]
    #: explicit (R, Dr) pairs; when None, `ranks` x `ropes` below apply
    rank_rope: Optional[frozenset[tuple[int, int]]] = None
    ranks: Optional[frozenset[int]] = None
    ropes: Optional[frozenset[int]] = None
    page_sizes: Optional[frozenset[int]] = None  # None = any
    max_heads: Optional[int] = None
    #: open interval of head counts the kernel rejects (trtllm-gen: 64 < N < 128)
    heads_excluded: Optional[tuple[int, int]] = None
    sources: tuple[str, ...] = ()
    notes: str = ""
    #: "measured": shown on hardware (DESIGN or our runs); "source": read from FlashInfer's code/tests only
    evidence: str = "source"

    def covers(self, version: Version) -> bool:
        return self.min_version <= version < self.max_version

    def version_range(self) -> str:
        return version_range(self.min_version, self.max_version)

    def allowed_rank_rope(self) -> str:
        if self.rank_rope is not None:
            return ", ".join(f"({r},{d})" for r, d in sorted(self.rank_rope))
        return f"R in {sorted(self.ranks or ())}, Dr in {sorted(self.ropes or ())}"


def version_range(lo: Version, hi: Version) -> str:
    return f"[{'.'.join(map(str, lo))}, {'.'.join(map(str, hi))})"


@dataclass(frozen=True)
class KnownFailure:
    """A measured failure: dims that must never reach the kernel on these versions."""

    kernel: str
    min_version: Version
    max_version: Version
    kv_lora_rank: int
    what: str
    source: str


_BF16_FP16 = frozenset({torch.bfloat16, torch.float16})
_FA2_SMS = frozenset({80, 86, 89, 100, 103})  # Ampere, Ada, Blackwell datacenter; SM90 uses fa3
# Page sizes the MLA wrapper is shown to handle: 1/16/32 in FlashInfer's tests, 64 in DESIGN §12 and
# in our H200 run. The kernels take any page size in principle; others are refused until measured.
_FA_PAGES = frozenset({1, 16, 32, 64})

FLASHINFER_FACTS: tuple[KernelFacts, ...] = (
    # ---- BatchMLAPagedAttentionWrapper, FlashInfer 0.6.x: DeepSeek dims only.
    KernelFacts(
        "flashinfer_mla", "fa3", (0, 6, 0), (0, 7, 0), frozenset({90}), _BF16_FP16,
        rank_rope=frozenset({(512, 64)}), page_sizes=_FA_PAGES, max_heads=128,
        sources=("DESIGN8", "FI_0618_SRC", "FI_TESTS", "H200_RUN"),
        notes="0.6.x plan() validates no dims; R=256 crashed with an illegal memory access (DESIGN §8).",
        evidence="measured",
    ),
    KernelFacts(
        "flashinfer_mla", "fa2", (0, 6, 0), (0, 7, 0), _FA2_SMS, _BF16_FP16,
        rank_rope=frozenset({(512, 64)}), page_sizes=_FA_PAGES, max_heads=128,
        sources=("DESIGN8", "FI_0618_SRC", "FI_TESTS"),
        notes="same template as fa3 for dims; not run on hardware by this project.",
    ),
    # ---- FlashInfer 0.7.x: more ranks. Dr is limited to {0, 64}: Dr=128 is a multiple of 64 but
    # its fa3 shared-memory footprint at R=512 exceeds the per-block limit (FI_MAIN_SRC's
    # _generated_fa_shared_bytes), and no model we serve needs it.
    KernelFacts(
        "flashinfer_mla", "fa3", (0, 7, 0), (0, 8, 0), frozenset({90}), _BF16_FP16,
        ranks=frozenset({128, 256, 512}), ropes=frozenset({0, 64}), page_sizes=_FA_PAGES, max_heads=128,
        sources=("DESIGN8", "FI_MAIN_SRC"),
        notes="(512,64) and (256,64) measured with 0.7.2 on H200 (DESIGN §12); 128 and Dr=0 from source.",
        evidence="measured",
    ),
    KernelFacts(
        "flashinfer_mla", "fa2", (0, 7, 0), (0, 8, 0), _FA2_SMS, _BF16_FP16,
        ranks=frozenset({128, 256, 384, 512}), ropes=frozenset({0, 64}), page_sizes=_FA_PAGES, max_heads=128,
        sources=("DESIGN8", "FI_MAIN_SRC"),
        notes="R % 128 == 0 (capped at 512: larger ranks exceed fa2 shared memory), Dr % 64 == 0.",
    ),
    # ---- Sparse MLA (DSA) through the same wrapper with pages of one token (flashinfer_sparse.py):
    # page size 1 is in FlashInfer's MLA tests; 0.7.x checks each request's CSR span against its
    # length, which the packed slot layout meets. Dims as for the dense wrapper of the same version.
    KernelFacts(
        "flashinfer_mla_sparse", "fa3", (0, 7, 0), (0, 8, 0), frozenset({90}), _BF16_FP16,
        ranks=frozenset({128, 256, 512}), ropes=frozenset({0, 64}), page_sizes=frozenset({1}), max_heads=128,
        sources=("FI_MAIN_SRC", "FI_TESTS", "FI_072_SRC"),
        notes="one request per query token over its selected slots; (512,64) and (256,64) run on the H200 "
        "(tests/test_sparse_attention.py GPU tests, docs/benchmarks/sparse_mla.md, 2026-11-24); 128 and Dr=0 from source.",
        evidence="measured",
    ),
    KernelFacts(
        "flashinfer_mla_sparse", "fa2", (0, 7, 0), (0, 8, 0), _FA2_SMS, _BF16_FP16,
        ranks=frozenset({128, 256, 384, 512}), ropes=frozenset({0, 64}), page_sizes=frozenset({1}), max_heads=128,
        sources=("FI_MAIN_SRC", "FI_TESTS", "FI_072_SRC"),
        notes="as the fa3 record; not run on hardware by this project.",
    ),
    # ---- trtllm_batch_decode_with_kv_cache_mla (TRT-LLM-gen, Blackwell datacenter only).
    KernelFacts(
        "flashinfer_trtllm_mla", "trtllm-gen", (0, 6, 0), (0, 8, 0), frozenset({100, 103}),
        frozenset({torch.bfloat16}), rank_rope=frozenset({(512, 64)}), page_sizes=frozenset({32, 64}),
        max_heads=128, heads_excluded=(64, 128),
        sources=("DESIGN8", "FI_0618_SRC"),
        notes="decode only; block-table width a multiple of 128/page_size; zeroed workspace; "
        "untested on hardware by this project (no SM100 available).",
    ),
    KernelFacts(
        "flashinfer_trtllm_mla", "trtllm-gen", (0, 6, 18), (0, 8, 0), frozenset({100, 103}),
        frozenset({torch.bfloat16}), rank_rope=frozenset({(256, 64)}), page_sizes=frozenset({32, 64}),
        max_heads=128, heads_excluded=(64, 128),
        sources=("DESIGN8", "FI_0618_SRC"),
        notes="(256,64) is listed as supported by _check_trtllm_gen_mla_shape from 0.6.18; untested on hardware.",
    ),
)

#: FlashInfer 0.7.2's dedicated sparse-MLA entry points and where they run (FI_072_SRC: mla/_core.py
#: `trtllm_batch_decode_with_kv_cache_mla(sparse_mla_top_k=...)`, whose backend "auto" picks trtllm-gen
#: on SM10x, "sparse" on SM12x and raises on any other major; dsa_sparse_attention.py and
#: dsa_indexer.py: "SM100/SM103/SM107 only", 64 / 32 heads, training). None runs on Hopper, so
#: `flashinfer_mla_sparse` uses the dense wrapper there (above); calling these is left for a machine
#: that has them.
SPARSE_NOTES: Mapping[str, str] = MappingProxyType({
    "trtllm_batch_decode_with_kv_cache_mla(sparse_mla_top_k>0)": "SM100/103 (trtllm-gen), SM12x (sparse); "
    "(R, Dr) in {(512, 64), (512, 0)}; raises on SM90",
    "dsa_sparse_attention": "SM100/103/107, 64 query heads, training",
    "dsa_indexer_topk": "SM100/103/107, 32 heads x 128, training",
    "top_k_page_table_transform": "any CUDA GPU (radix; clusters kernel on SM100); CUDA-graph safe mode; its JIT "
    "build did not finish in 9 minutes on the H200 (2026-11-24), so the selection stays on torch.topk",
})

KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    KnownFailure(
        "fa3", (0, 6, 0), (0, 7, 0), 256,
        "FlashInfer 0.6.18.post1 with R=256 did not raise: it crashed with an illegal memory access, "
        "poisoning the CUDA context",
        "DESIGN8",
    ),
)

# ---------------------------------------------------------------- plan-time limits (per step)
#: MLAPlan's fixed work-list capacity (scheduler.cuh `max_total_num_works`). 0.6.x does not check
#: it: a plan needing more work items writes past its int-workspace arrays. Steps over it go to the
#: fallback op (FI_0618_SRC, FI_MAIN_SRC `_FA_MAX_WORK_ITEMS`).
FA_MAX_WORK_ITEMS = 16384

#: Causal tile-boundary defect (FI_MAIN_SRC `_validate_fa_causal_tile_bound`, present in the 0.6.18
#: kernels too: scheduler.cuh uses ceil(tile_end / N), mla_hopper.cuh/mla.cuh use floor). When the
#: query tile (64 or 128 packed rows = tokens x heads) is not a multiple of N, a query whose rows
#: straddle a tile end can lose its last visible key. With q_len == 1 and N <= 128 no request
#: straddles a tile, so decode is safe; multi-token (prefill) work is safe when N divides 64 (both
#: tile sizes) or N == 128 (N > 64 forces the 128-row tile). Other N: prefill steps use the fallback.
FA_PREFILL_SAFE_HEADS = frozenset({1, 2, 4, 8, 16, 32, 64, 128})


def fa_prefill_safe(num_heads: int) -> bool:
    return num_heads in FA_PREFILL_SAFE_HEADS


# ---------------------------------------------------------------- lookups used by check()
def flashinfer_version(versions: Mapping[str, Optional[str]]) -> tuple[Optional[str], Optional[Version]]:
    raw = versions.get("flashinfer")
    return raw, parse_version(raw)


def fa_kernel_for(device: DeviceInfo) -> Optional[str]:
    """The wrapper kernel FlashInfer would pick: fa3 on SM90 (Hopper), fa2 elsewhere from SM80."""
    if device.type != "cuda" or device.sm is None:
        return None
    if device.sm == 90:
        return "fa3"
    if device.sm >= 80:
        return "fa2"
    return None


def facts_for(backend: str, kernel: str, version: Version) -> list[KernelFacts]:
    return [f for f in FLASHINFER_FACTS if f.backend == backend and f.kernel == kernel and f.covers(version)]


def known_versions(backend: str) -> str:
    ranges = sorted({f.version_range() for f in FLASHINFER_FACTS if f.backend == backend})
    return ", ".join(ranges)


def _dims_violation(f: KernelFacts, dims: MLADims, dtype: torch.dtype, device: DeviceInfo, page_size: int) -> Optional[str]:
    """First rule of `f` the node breaks (None = the record accepts it)."""
    r, dr, n = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.num_heads
    if device.sm not in f.sms:
        return f"{f.kernel} runs on SM{{{','.join(map(str, sorted(f.sms)))}}}, this is {device.short()}"
    if dtype not in f.dtypes:
        names = "/".join(sorted(str(d).replace("torch.", "") for d in f.dtypes))
        return f"dtype {str(dtype).replace('torch.', '')} unsupported by {f.kernel} (needs {names})"
    if f.rank_rope is not None:
        if (r, dr) not in f.rank_rope:
            return f"(R, Dr)=({r},{dr}) not supported by {f.kernel}; supported: {f.allowed_rank_rope()}"
    else:
        if r not in (f.ranks or ()) or dr not in (f.ropes or ()):
            return f"(R, Dr)=({r},{dr}) not supported by {f.kernel}; supported: {f.allowed_rank_rope()}"
    if f.page_sizes is not None and page_size not in f.page_sizes:
        return f"page_size={page_size} not supported by {f.kernel} (use one of {sorted(f.page_sizes)})"
    if f.max_heads is not None and n > f.max_heads:
        return f"N={n} heads over {f.kernel}'s limit of {f.max_heads}"
    if f.heads_excluded is not None and f.heads_excluded[0] < n < f.heads_excluded[1]:
        lo, hi = f.heads_excluded
        return f"N={n} heads: {f.kernel} rejects {lo} < N < {hi}"
    return None


def check_against_facts(backend: str, kernel: Optional[str], dims: MLADims, dtype: torch.dtype,
                        target: Target) -> CheckResult:
    """Shared part of the FlashInfer checks: library present, known version, device, dims."""
    device, page_size = target.device, target.page_size
    raw, ver = flashinfer_version(target.versions)
    if raw is None:
        return CheckResult(False, "flashinfer not installed (pip install flashinfer-python)")
    if ver is None:
        return CheckResult(False, f"flashinfer version {raw!r} is unparsable")
    if device.type != "cuda" or device.sm is None:
        return CheckResult(False, f"needs a CUDA GPU, target is {device.short()}")
    if kernel is None:
        return CheckResult(False, f"no FlashInfer MLA kernel for {device.short()} (needs SM80+)")
    known = [f for f in FLASHINFER_FACTS if f.backend == backend and f.kernel == kernel]
    if not known:
        return CheckResult(False, f"{backend} has no {kernel} kernel")
    recs = facts_for(backend, kernel, ver)
    if not recs:
        return CheckResult(
            False,
            f"flashinfer {raw}: no {kernel} capability facts for this version (known: {known_versions(backend)}); "
            "add a record to custom_ops/flashinfer/capabilities.py once it is measured",
        )
    for kf in KNOWN_FAILURES:
        if kf.kernel == kernel and kf.min_version <= ver < kf.max_version and kf.kv_lora_rank == dims.kv_lora_rank:
            return CheckResult(False, f"known failure on flashinfer {raw}: {kf.what} ({SOURCES[kf.source]})")
    reasons = []
    for f in recs:
        why = _dims_violation(f, dims, dtype, device, page_size)
        if why is None:
            return CheckResult(
                True,
                f"flashinfer {raw} {kernel} on SM{device.sm}: (R,Dr)=({dims.kv_lora_rank},{dims.qk_rope_head_dim}) "
                f"in {{{f.allowed_rank_rope()}}} ({f.evidence}; {', '.join(f.sources)})",
            )
        reasons.append(why)
    return CheckResult(False, f"flashinfer {raw}: " + "; ".join(dict.fromkeys(reasons)))


def fact_rows() -> list[dict]:
    out = []
    for f in FLASHINFER_FACTS:
        out.append({
            "backend": f.backend, "kernel": f.kernel, "versions": f.version_range(),
            "sm": sorted(f.sms), "dtypes": sorted(str(d).replace("torch.", "") for d in f.dtypes),
            "rank_rope": f.allowed_rank_rope(), "page_sizes": sorted(f.page_sizes) if f.page_sizes else "any",
            "max_heads": f.max_heads, "heads_excluded": f.heads_excluded, "evidence": f.evidence,
            "sources": list(f.sources), "notes": f.notes,
        })
    return out


# ---------------------------------------------------------------- FP8 latent caches
@dataclass(frozen=True)
class CacheFacts:
    """One kernel family reading a paged cache of `cache_dtype` (other than the activations' dtype)."""

    backend: str
    kernel: str
    min_version: Version
    max_version: Version  # exclusive
    sms: frozenset[int]
    cache_dtype: torch.dtype
    dtypes: frozenset[torch.dtype]  # activation dtypes the op accepts around it
    rank_rope: frozenset[tuple[int, int]]
    query: str  # how queries reach the kernel: "bf16" (as they are) | "e4m3" (quantised per step)
    sources: tuple[str, ...] = ()
    notes: str = ""
    evidence: str = "source"

    def covers(self, version: Version) -> bool:
        return self.min_version <= version < self.max_version


CACHE_FACTS: tuple[CacheFacts, ...] = (
    CacheFacts(
        "flashinfer_mla", "fa3", (0, 7, 2), (0, 8, 0), frozenset({90}), torch.float8_e4m3fn,
        frozenset({torch.bfloat16}), frozenset({(512, 0), (512, 64)}), "bf16",
        sources=("FI_072_SRC",),
        notes="fa3 converts e4m3 tiles in shared memory; per-tensor ckv_scale / kpe_scale.",
    ),
    CacheFacts(
        "flashinfer_trtllm_mla", "trtllm-gen", (0, 7, 2), (0, 8, 0), frozenset({100, 103}), torch.float8_e4m3fn,
        frozenset({torch.bfloat16}), frozenset({(512, 64)}), "e4m3",
        sources=("FI_072_SRC",),
        notes="query and KV must share a dtype: queries are quantised to e4m3 each step with a device-side amax "
        "scale (tensor bmm1_scale); untested on hardware (no SM100 available).",
    ),
)


def check_cache_against_facts(backend: str, kernel: Optional[str], dims: MLADims, dtype: torch.dtype,
                              cache_dtype: torch.dtype, target: Target) -> CheckResult:
    """Whether `kernel` of `backend` reads a `cache_dtype` cache for this node (same dtype: always)."""
    name = cache_dtype_name(cache_dtype)
    if cache_dtype == dtype:
        return CheckResult(True, "cache in the model dtype")
    raw, ver = flashinfer_version(target.versions)
    recs = [f for f in CACHE_FACTS if f.backend == backend and f.kernel == kernel and f.cache_dtype == cache_dtype]
    if not recs:
        return CheckResult(False, f"no {name} cache facts for {backend} ({kernel})")
    if ver is None:
        return CheckResult(False, f"flashinfer {raw!r}: version unknown")
    reasons = []
    for f in recs:
        if not f.covers(ver):
            reasons.append(f"{kernel} reads a {name} cache from flashinfer "
                           f"{version_range(f.min_version, f.max_version)}, installed {raw}")
        elif target.device.sm not in f.sms:
            reasons.append(f"{kernel} reads a {name} cache on SM{{{','.join(map(str, sorted(f.sms)))}}}, "
                           f"this is {target.device.short()}")
        elif dtype not in f.dtypes:
            needs = "/".join(sorted(cache_dtype_name(d) for d in f.dtypes))
            reasons.append(f"{kernel} with a {name} cache needs {needs} activations, got {cache_dtype_name(dtype)}")
        elif (dims.kv_lora_rank, dims.qk_rope_head_dim) not in f.rank_rope:
            pairs = ", ".join(f"({r},{d})" for r, d in sorted(f.rank_rope))
            reasons.append(f"{kernel} reads a {name} cache for (R, Dr) in {{{pairs}}}, node has "
                           f"({dims.kv_lora_rank},{dims.qk_rope_head_dim})")
        else:
            return CheckResult(True, f"{name} cache: {kernel} (queries {f.query}; {f.evidence}; {', '.join(f.sources)})")
    return CheckResult(False, "; ".join(dict.fromkeys(reasons)))

