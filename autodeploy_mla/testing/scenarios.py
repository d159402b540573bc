"""Scenario harness for cached MLA ops: drive a backend through multi-step schedules (chunked
prefill, mixed prefill+decode, long decode) over a shuffled paged cache and compare every token's
output with the uncached `torch_mla` source op on the whole sequence.

Used by the CPU tests of every backend, the GPU tests and the benchmarks, so all backends are held
to the same oracle. The backend runs as in a model: one session from `setup()`, prepared every step
and published to the op with `using_sessions`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..custom_ops.attention.registry import BackendSession, MLABackend, SessionSpec, Target, get_backend
from ..custom_ops.attention.cache_format import UNIT_SCALES, CacheScales, dequantize_rows, quantize_rows
from ..custom_ops.attention.mla_dims import MLADims
from ..custom_ops.attention.step_context import using_sessions
from ..runtime.model_runner import step_descriptor
from ..runtime.page_allocator import PageAllocator
from ..runtime.sequence_info import SequenceInfo, StepSequence


@dataclass
class MLASequenceData:
    """Full-sequence MLA inputs of one sequence, [1, S, ...] bsnd."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    compressed_kv: torch.Tensor
    kpe: torch.Tensor

    @property
    def length(self) -> int:
        return self.q_nope.shape[1]


def random_sequence(dims: MLADims, length: int, dtype: torch.dtype, device, gen: torch.Generator) -> MLASequenceData:
    def r(*shape):
        return torch.randn(*shape, generator=gen, device="cpu", dtype=torch.float32).to(device=device, dtype=dtype)

    n, dn, dr, rk = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.kv_lora_rank
    return MLASequenceData(r(1, length, n, dn), r(1, length, n, dr), r(1, length, rk), r(1, length, 1, dr))


def random_kv_b_weight(dims: MLADims, dtype, device, gen: torch.Generator) -> torch.Tensor:
    rows = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    w = torch.randn(rows, dims.kv_lora_rank, generator=gen) * dims.kv_lora_rank**-0.5
    return w.to(device=device, dtype=dtype)


@dataclass
class ScenarioResult:
    outputs: dict[int, torch.Tensor]  # seq_id -> [S, N, Dv] from the cached op
    reference: dict[int, torch.Tensor]  # seq_id -> [S, N, Dv] from torch_mla (fp32 or fp64)
    cache: torch.Tensor
    steps: int = 0
    session: Optional[BackendSession] = None
    extra: dict = field(default_factory=dict)

    def max_rel_error(self) -> float:
        """max |out - ref| / max |ref| over all sequences."""
        num = max((self.outputs[s].double() - self.reference[s].double()).abs().max().item() for s in self.outputs)
        den = max(self.reference[s].double().abs().max().item() for s in self.outputs)
        return num / max(den, 1e-30)


def run_scenario(
    backend: str | MLABackend,
    dims: MLADims,
    schedule: Sequence[dict[int, int]],
    *,
    page_size: int = 4,
    num_pages: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    scale: float | None = None,
    seed: int = 0,
    shuffle_pages: bool = True,
    ref_dtype: torch.dtype = torch.float64,
    pad_to: dict[int, int] | None = None,
    max_batch_size: int | None = None,
    policy: Any = None,
    graph_buckets: Collection[int] = (),
    mixed_graph_max_tokens: int = 0,
    target: Optional[Target] = None,
    cache_dtype: Optional[torch.dtype] = None,
    cache_scales: CacheScales = UNIT_SCALES,
) -> ScenarioResult:
    """Run `schedule` (one dict per step: seq_id -> new tokens this step) through `backend`.

    Sequence lengths are the sums over the schedule. `pad_to` maps step index -> padded token count.
    `policy`: the backend's policy for its session. `graph_buckets`: decode-only steps padded to one
    of these sizes are described to the session as CUDA-graph steps (as the model runner does);
    with `mixed_graph_max_tokens`, so are other steps padded to a bucket up to that size, as
    static-bounds (mixed graph) steps. `extra["padded_rows"]`: each step's outputs of its padded tokens.
    `target`: default `Target.detect(device, page_size)`. `cache_dtype` (default `dtype`) and
    `cache_scales`: the paged cache's format. With a quantised cache the reference sees the latent
    and rope key rounded exactly as the cache stores them (so it checks the kernels, not the format);
    `extra["unquantized"]` holds the reference on the original values.
    """
    be = get_backend(backend) if isinstance(backend, str) else backend
    gen = torch.Generator().manual_seed(seed)
    lengths: dict[int, int] = {}
    for step in schedule:
        for sid, n in step.items():
            lengths[sid] = lengths.get(sid, 0) + n
    data = {sid: random_sequence(dims, n, dtype, device, gen) for sid, n in lengths.items()}
    w = random_kv_b_weight(dims, dtype, device, gen)

    max_seq_len = max(lengths.values())
    max_tokens = max(max(sum(s.values()) for s in schedule), *(pad_to or {0: 0}).values())
    bsz = max_batch_size or max(len(s) for s in schedule) + max(0, max_tokens)
    pages_per_seq = -(-max_seq_len // page_size)
    num_pages = num_pages or 1 + pages_per_seq * len(lengths) + 3
    alloc = PageAllocator(num_pages, page_size, pages_per_seq)
    if shuffle_pages:
        random.Random(seed).shuffle(alloc._free)
    info = SequenceInfo(bsz, max_tokens, max_seq_len, page_size, device)
    # Poisoned cache: a slot read before it is written shows up as NaN.
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    cache = torch.full((num_pages, page_size, dims.latent_dim), float("nan"), device=device).to(cache_dtype)
    target = target or Target.detect(device, page_size)
    session = be.setup(SessionSpec((dims,), dtype, torch.device(device), target, bsz, max_tokens,
                                   info.max_pages_per_seq, (cache_dtype,)), policy)

    done = {sid: 0 for sid in lengths}
    outs = {sid: [] for sid in lengths}
    padded_rows: list[torch.Tensor] = []
    for k, step in enumerate(schedule):
        alloc.ensure_many({sid: done[sid] + n for sid, n in step.items()})
        seqs = [StepSequence(sid, [0] * n, done[sid]) for sid, n in step.items()]
        order = info.prepare_step(seqs, alloc.pages_of, pad_to=(pad_to or {}).get(k))
        session.prepare(info, step_descriptor(info, graph_buckets, mixed_graph_max_tokens))
        t_pad = info.num_padded_tokens

        def flat(attr: str) -> torch.Tensor:
            parts = [getattr(data[sid], attr)[:, done[sid] : done[sid] + step[sid]] for sid in order]
            x = torch.cat(parts, dim=1)
            if t_pad > x.shape[1]:
                pad = torch.randn(1, t_pad - x.shape[1], *x.shape[2:], generator=gen).to(x)
                x = torch.cat([x, pad], dim=1)
            return x

        args = [flat("q_nope"), flat("q_pe"), flat("compressed_kv"), flat("kpe"), w]
        args += [info.get(m) for m in be.metadata]
        with using_sessions({be.name: session}):
            out = be.cached_op(*args, cache, scale, cache_scales.latent, cache_scales.rope)
        padded_rows.append(out[0, info.num_tokens:])
        off = 0
        for sid in order:
            outs[sid].append(out[0, off : off + step[sid]])
            off += step[sid]
        for sid, n in step.items():
            done[sid] += n

    def reference(quantized: bool) -> dict[int, torch.Tensor]:
        ref = {}
        for sid, d in data.items():
            ckv, kpe = d.compressed_kv, d.kpe
            if quantized:
                rows = dequantize_rows(quantize_rows(ckv, kpe[:, :, 0], cache_dtype, cache_scales), dims.kv_lora_rank,
                                       torch.float64, cache_scales)
                ckv, kpe = rows[..., : dims.kv_lora_rank], rows[..., dims.kv_lora_rank:].unsqueeze(2)
            r = torch.ops.autodeploy.torch_mla(
                d.q_nope.to(ref_dtype), d.q_pe.to(ref_dtype), ckv.to(ref_dtype), kpe.to(ref_dtype),
                w.to(ref_dtype), True, scale, "bsnd",
            )
            ref[sid] = r[0]
        return ref

    quantized = cache_dtype != dtype
    res = ScenarioResult({sid: torch.cat(o) for sid, o in outs.items()}, reference(quantized), cache, len(schedule),
                         session)
    res.extra["padded_rows"] = padded_rows
    if quantized:
        res.extra["unquantized"] = reference(False)
    return res


# The MLA dims of the published models (DeepSeek-V3 at TP1 and TP8, Mistral-Small-4, GLM-4.7-Flash,
# MiniCPM3), for kernel tests on the GPU.
REAL_MLA_DIMS: dict[str, MLADims] = {
    "deepseek_v3_n128": MLADims(128, 128, 64, 128, 512),
    "deepseek_v3_tp8_n16": MLADims(16, 128, 64, 128, 512),
    "mistral_small_4": MLADims(32, 64, 64, 128, 256),
    "glm_4_7_flash": MLADims(20, 192, 64, 256, 512),
    "minicpm3": MLADims(40, 64, 32, 64, 256),
}

# Schedules every backend is tested on: name -> list of steps.
STANDARD_SCHEDULES: dict[str, list[dict[int, int]]] = {
    "single_prefill": [{0: 7}],
    "ragged_prefill": [{0: 5, 1: 1, 2: 9, 3: 3}],
    "chunked_prefill_3": [{0: 6}, {0: 5}, {0: 4}],
    "prefill_then_decode": [{0: 5, 1: 3}] + [{0: 1, 1: 1}] * 6,
    "mixed": [{0: 6}, {0: 1, 1: 7}, {0: 1, 1: 1, 2: 5}, {2: 4, 0: 1, 1: 1}, {0: 1, 1: 1, 2: 1}],
    "long_decode": [{0: 3, 1: 2, 2: 1}] + [{0: 1, 1: 1, 2: 1}] * 14,
}
