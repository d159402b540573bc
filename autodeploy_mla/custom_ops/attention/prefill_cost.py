"""Which path a step with prefill tokens is cheaper on, from its FLOPs under the node's dims.

MLA can attend two ways. Absorbed (FlashInfer's MLA kernel): queries are mapped into the latent
space (q·W_kn) and score the cached latent directly — no K/V is materialised, but every score and
every value product is R + Dr and R wide. Expanded (our Triton prefill): the cached latents of each
prefilling sequence are expanded once into per-head K [Dn] and V [Dv] (a GEMM), then attention runs
on Dn + Dr / Dv-wide heads. Absorbed costs about (2R + Dr) / (Dn + Dr + Dv) times the attention
FLOPs of expanded (3.4x for DeepSeek's dims, 2.1x for GLM-4.7-Flash's) but skips the expansion, so
which is cheaper depends on the dims, the query and context lengths, and each path's fixed cost.

`PrefillCostFacts` holds each path's measured throughput and fixed per-call cost on one device
class, with the measurement it comes from; `path_costs` turns a step's (query length, kv length)
per sequence and a node's dims into an estimated time per path. The FlashInfer backend's policy
routes a step to the fallback op when that estimate is lower (FlashInferPolicy.prefill="auto").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .mla_dims import MLADims


@dataclass(frozen=True)
class PathCost:
    """One path's measured speed: sustained TFLOP/s on its prefill work, the decode tokens of a
    mixed step (absorbed on both paths), and the fixed cost of one op call (launches, host work)."""

    prefill_tflops: float
    decode_tflops: float
    overhead_us: float


@dataclass(frozen=True)
class PrefillCostFacts:
    absorbed: PathCost  # FlashInfer's absorbed MLA
    expanded: PathCost  # the fallback op (Triton): expanded prefill, absorbed decode
    source: str


#: Fit to the eager per-op times of docs/benchmarks/flashinfer_plan.md (H200, bf16, page 64, R 512,
#: Dr 64, Dn = Dv 128; N = 128 and N = 16; 1x128 .. 8x512 fresh, 4x512 on 3584 cached, mixed steps):
#: absorbed ~500 TFLOP/s + ~150 us, Triton expanded ~480 TFLOP/s + ~240 us (its per-call floor,
#: issue 14), Triton absorbed decode ~170 TFLOP/s at N = 128. The fit reproduces every routing
#: decision of that table (and calls N = 16 x 2 x 2048 a near tie, as measured: 366 vs 368 us).
SM90_FACTS = PrefillCostFacts(
    absorbed=PathCost(prefill_tflops=500.0, decode_tflops=500.0, overhead_us=150.0),
    expanded=PathCost(prefill_tflops=480.0, decode_tflops=170.0, overhead_us=240.0),
    source="docs/benchmarks/flashinfer_plan.md (H200, FlashInfer 0.6.18 fa3, Triton 3.6), fit in prefill_cost.py",
)


@dataclass(frozen=True)
class StepFlops:
    absorbed: float  # the whole step on the absorbed path
    expanded_prefill: float  # prefilling sequences on the expanded path (K/V expansion + attention)
    decode: float  # single-token sequences (absorbed on either path)


def step_flops(dims: MLADims, qo_lens: torch.Tensor, kv_lens: torch.Tensor) -> StepFlops:
    """FLOPs of one layer's attention for a step: qo_lens / kv_lens per sequence (host tensors; kv
    includes this step's tokens). Causal: new token j of a sequence sees kv - q + j + 1 keys."""
    n, r, dr, dn, dv = (dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim,
                        dims.v_head_dim)
    # NumPy on the host mirrors: this runs in every prefill step's prepare, and a dozen torch ops on
    # tiny CPU tensors cost ~100 us there (~10 us this way)
    q = (qo_lens.numpy() if isinstance(qo_lens, torch.Tensor) else np.asarray(qo_lens)).astype(np.float64)
    kv = (kv_lens.numpy() if isinstance(kv_lens, torch.Tensor) else np.asarray(kv_lens)).astype(np.float64)
    visible = q * (kv - q) + q * (q + 1) / 2  # score entries per head, per sequence
    pre = q > 1
    # absorbed: q·W_kn and latent·W_v per token, then scores (R + Dr) and values (R) per entry
    per_token_proj = 2.0 * n * (dn * r + r * dv)
    absorbed = per_token_proj * q + 2.0 * n * (2 * r + dr) * visible
    # expanded: expand every cached latent of the sequence into K_nope and V, then Dn+Dr / Dv attention
    expanded = 2.0 * n * r * (dn + dv) * kv + 2.0 * n * (dn + dr + dv) * visible
    return StepFlops(absorbed=float(absorbed.sum()), expanded_prefill=float(expanded[pre].sum()),
                     decode=float(absorbed[~pre].sum()))


def path_costs(dims: MLADims, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
               facts: PrefillCostFacts = SM90_FACTS) -> tuple[float, float]:
    """(absorbed us, expanded us): estimated time of one layer's attention for the step per path."""
    f = step_flops(dims, qo_lens, kv_lens)
    a, e = facts.absorbed, facts.expanded
    absorbed = a.overhead_us + f.absorbed / (a.prefill_tflops * 1e6)
    expanded = e.overhead_us + f.expanded_prefill / (e.prefill_tflops * 1e6) + f.decode / (e.decode_tflops * 1e6)
    return absorbed, expanded


__all__ = ["PathCost", "PrefillCostFacts", "SM90_FACTS", "StepFlops", "path_costs", "step_flops"]
