"""Block-FP8 MoE experts: `torch.ops.autodeploy.torch_moe_experts_fp8` (reference) and
`triton_moe_experts_fp8` (W8A8 on the existing expert layout), with the fp32 emulation tests use.

Same computation and routing as the 16-bit ops (ops.py), with stacked FP8 expert weights and their
block scales, DeepSeek-V3's checkpoint layout per expert:

    w_up   [E, 2I, H] float8_e4m3fn ([gate; up] rows), w_up_scale   [E, ceil(2I/bn), ceil(H/bk)] fp32
    w_down [E, H, I]  float8_e4m3fn,                    w_down_scale [E, ceil(H/bn), ceil(I/bk)] fp32

- reference: dequantize every expert to x.dtype, then the 16-bit reference (W8A16: activations
  unquantized). Runs anywhere; materializes the 16-bit experts, so it is for tests and small models.
- triton: activations quantized per token and K block (fp8.act_quant), the up GEMM with the gate and
  the intermediate's own quantization fused (fp8_kernels.up_fp8_kernel), the down GEMM with the routing
  weight fused, the sum over top-k in fp32 (W8A8: what DeepSeek's reference inference computes).
- `moe_experts_fp8_emulated`: the triton op's math in fp32 with the same quantizations (the oracle).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Optional

import torch

from ..fp8.act_quant import AMAX_FLOOR, FP8_MAX, act_quant, act_quant_reference
from ..fp8.emulation import dequantize_activations
from ..fp8.format import dequantize
from ..triton_helpers import interpreting
from .ops import HAS_TRITON, TRITON_IMPORT_ERROR, _persistent_programs, _sum_over_topk, check_moe_shapes, expert_layout
from .tuning import moe_fp8_config

FP8 = torch.float8_e4m3fn

try:
    import triton.language as tl

    from . import fp8_kernels as FK

    _TL_DTYPE = MappingProxyType({torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32})
except ImportError:  # pragma: no cover - exercised only without triton
    FK = None


def check_moe_fp8_inputs(name: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w_up: torch.Tensor, w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                         block_n: int, block_k: int, activation: str) -> tuple[int, int, int, int, int]:
    """(T, k, E, H, I) of a valid call; ValueError naming the offending tensor otherwise."""
    if block_n < 1 or block_k < 1:
        raise ValueError(f"{name}: block size ({block_n}, {block_k}) must be positive")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x must be fp32/bf16/fp16, got {x.dtype}")
    t, k_top, e, h, i = check_moe_shapes(name, x, topk_ids, topk_weights, w_up, w_down, activation)
    two_i = 2 * i
    for wname, w in (("w_up", w_up), ("w_down", w_down)):
        if w.dtype != FP8:
            raise ValueError(f"{name}: {wname} must be float8_e4m3fn, got {w.dtype}")
    for sname, s, (rows, cols) in (("w_up_scale", w_up_scale, (two_i, h)), ("w_down_scale", w_down_scale, (h, i))):
        want = (e, -(-rows // block_n), -(-cols // block_k))
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name}: {sname} must be float32 [E, ceil({rows}/{block_n}), ceil({cols}/{block_k})] = "
                             f"{list(want)}, got {s.dtype} {list(s.shape)}")
    return t, k_top, e, h, i


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] `dtype` from stacked FP8 experts and their [E, NB, KB] block scales (format.dequantize)."""
    return dequantize(w, scale, (block_n, block_k), dtype)


# ----------------------------------------------------------------------------- reference
@torch.library.custom_op("autodeploy::torch_moe_experts_fp8", mutates_args=())
def torch_moe_experts_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                          w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, block_n: int,
                          block_k: int, activation: str = "silu") -> torch.Tensor:
    """Reference: the experts dequantized to x.dtype, then the 16-bit reference op's math."""
    check_moe_fp8_inputs("torch_moe_experts_fp8", x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale,
                         block_n, block_k, activation)
    return torch.ops.autodeploy.torch_moe_experts(
        x, topk_ids, topk_weights, dequantize_experts(w_up, w_up_scale, block_n, block_k, x.dtype),
        dequantize_experts(w_down, w_down_scale, block_n, block_k, x.dtype), activation)


@torch_moe_experts_fp8.register_fake
def _(x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale, block_n, block_k, activation="silu"):
    check_moe_fp8_inputs("torch_moe_experts_fp8", x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale,
                         block_n, block_k, activation)
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------- emulation (the oracle)
def moe_experts_fp8_emulated(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                             w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, block_n: int,
                             block_k: int) -> torch.Tensor:
    """The W8A8 op in fp32: x quantized per token and block_k columns, each expert's silu(gate) * up
    rounded to x.dtype and quantized the same way, fp32 products of the dequantized operands."""
    t, k, e, h, i = check_moe_fp8_inputs("moe_experts_fp8_emulated", x, topk_ids, topk_weights, w_up, w_up_scale,
                                         w_down, w_down_scale, block_n, block_k, "silu")
    xd = dequantize_activations(*act_quant_reference(x, block_k), block_k)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for ex in topk_ids.unique().tolist():  # only the experts routed to are dequantized (full-size benchmarks)
        wt = (topk_weights.float() * (topk_ids == ex)).sum(-1)
        rows = (topk_ids == ex).any(-1)
        wu = dequantize_experts(w_up[ex:ex + 1], w_up_scale[ex:ex + 1], block_n, block_k, torch.float32)[0]
        wd = dequantize_experts(w_down[ex:ex + 1], w_down_scale[ex:ex + 1], block_n, block_k, torch.float32)[0]
        gu = xd[rows] @ wu.t()
        mid = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).to(x.dtype)
        md = dequantize_activations(*act_quant_reference(mid, block_k), block_k)
        out[rows] += (md @ wd.t()) * wt[rows, None]
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- Triton
def fused_moe_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                  w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, block_n: int,
                  block_k: int, block_m: Optional[int] = None, down_n: Optional[int] = None,
                  activation: str = "silu", num_warps: Optional[int] = None,
                  num_stages: Optional[int] = None, persistent_sorted: Optional[bool] = None) -> torch.Tensor:
    """The Triton W8A8 experts computation. `block_m` / `down_n` / `num_warps` / `num_stages` /
    `persistent_sorted`: launch config overrides (tests, benchmarks; None = the config's). The up kernel's
    tiles stay block_k x block_k. `persistent_sorted`: the rows' FP8 codes and scales copied into expert order
    once, then persistent GEMMs over them (`_sorted_gemms`; the default from 32 pairs per expert, moe_fp8_config)."""
    if not HAS_TRITON or FK is None:
        raise RuntimeError(f"triton_moe_experts_fp8 needs triton ({TRITON_IMPORT_ERROR}); pip install 'triton>=3.4'")
    t, k, e, h, i = check_moe_fp8_inputs("triton_moe_experts_fp8", x, topk_ids, topk_weights, w_up, w_up_scale, w_down,
                                         w_down_scale, block_n, block_k, activation)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"triton_moe_experts_fp8: K block {block_k} must be a power of two >= 16 (the activation "
                         "groups are kernel tiles)")
    for wname, w in (("w_up", w_up), ("w_down", w_down)):
        if w.stride(2) != 1:
            raise ValueError(f"triton_moe_experts_fp8: {wname} must be contiguous along its last dim, strides "
                             f"{w.stride()}")
    n = t * k
    if n == 0:
        return x.new_zeros(t, h)
    compiled = x.device.type == "cuda" and not interpreting()
    cfg = moe_fp8_config(n, e, h, i, block_k, compiled)
    cfg = replace(cfg, block_m=block_m or cfg.block_m, down_n=down_n or cfg.down_n, num_warps=num_warps or cfg.num_warps,
                  num_stages=num_stages or cfg.num_stages,
                  persistent_sorted=cfg.persistent_sorted if persistent_sorted is None else persistent_sorted)
    layout = expert_layout(topk_ids.reshape(-1), e, cfg)
    max_blocks = layout.block_expert.shape[0]
    slots = max_blocks * cfg.block_m
    xq, xs = act_quant(x, block_k)
    mid_q = torch.empty(slots, i, dtype=FP8, device=x.device)
    mid_s = torch.empty(slots, -(-i // block_k), dtype=torch.float32, device=x.device)
    if cfg.persistent_sorted:
        pair_out = _sorted_gemms(xq, xs, w_up, w_up_scale, w_down, w_down_scale, topk_weights.reshape(-1), layout,
                                 mid_q, mid_s, cfg, n, k, h, i, block_n, block_k, x.dtype)
        return _sum_over_topk(pair_out, topk_ids, t, k, h)
    FK.up_fp8_kernel[(-(-i // block_k), max_blocks)](
        xq, xs, w_up, w_up_scale, layout.sorted_pairs, layout.block_expert, mid_q, mid_s, n, h, i,
        xq.stride(0), xs.stride(0), w_up.stride(0), w_up.stride(1), w_up_scale.stride(0), w_up_scale.stride(1),
        w_up_scale.stride(2), mid_q.stride(0), mid_s.stride(0),
        TOP_K=k, GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=cfg.block_m, BLOCK_N=block_k, BLOCK_K=block_k,
        MID_DTYPE=_TL_DTYPE[x.dtype], FP8_MAX_C=FP8_MAX, AMAX_FLOOR_C=AMAX_FLOOR, INTERPRETED=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pair_out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    FK.down_fp8_kernel[(-(-h // cfg.down_n), max_blocks)](
        mid_q, mid_s, w_down, w_down_scale, layout.sorted_pairs, layout.block_expert, topk_weights.reshape(-1),
        pair_out, n, i, h,
        mid_q.stride(0), mid_s.stride(0), w_down.stride(0), w_down.stride(1), w_down_scale.stride(0),
        w_down_scale.stride(1), w_down_scale.stride(2), pair_out.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_n, BLOCK_K=block_k,
        INTERPRETED=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _sum_over_topk(pair_out, topk_ids, t, k, h)


#: programs of a persistent FP8 GEMM under the interpreter: fewer than its tiles, so that the CPU tests walk
#: several tiles per program (on a GPU: one per SM)
INTERPRETED_PROGRAMS = 3


def _sorted_gemms(xq, xs, w_up, w_up_scale, w_down, w_down_scale, wts, layout, mid_q, mid_s, cfg, n: int, k: int,
                  h: int, i: int, block_n: int, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, H] per-pair outputs through the sorted-rows path: the quantized rows (codes + scales) copied into
    expert order (gather_fp8_kernel), then the persistent up and down GEMMs over them, both walking the
    blocks in use (`layout.num_blocks`, read on the device: no host sync, CUDA-graph safe)."""
    bm = cfg.block_m
    max_blocks = layout.block_expert.shape[0]
    slots, kb = max_blocks * bm, xs.shape[1]
    xq_s = torch.empty(slots, h, dtype=FP8, device=xq.device)
    xs_s = torch.empty(slots, kb, dtype=torch.float32, device=xq.device)
    FK.gather_fp8_kernel[(max_blocks, kb)](xq, xs, layout.sorted_pairs, layout.block_expert, xq_s, xs_s, n, h, kb,
                                           xq.stride(0), xs.stride(0), TOP_K=k, BLOCK_M=bm, GROUP_K=block_k)
    interp = interpreting()
    progs = _persistent_programs(xq.device, max_blocks * -(-i // block_k), INTERPRETED_PROGRAMS)
    FK.up_fp8_sorted_kernel[(progs,)](
        xq_s, xs_s, w_up, w_up_scale, layout.block_expert, layout.num_blocks, mid_q, mid_s, h, i,
        xq_s.stride(0), xs_s.stride(0), w_up.stride(0), w_up.stride(1), w_up_scale.stride(0), w_up_scale.stride(1),
        w_up_scale.stride(2), mid_q.stride(0), mid_s.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=bm, BLOCK_N=block_k, BLOCK_K=block_k, NUM_PROGRAMS=progs,
        MID_DTYPE=_TL_DTYPE[dtype], FP8_MAX_C=FP8_MAX, AMAX_FLOOR_C=AMAX_FLOOR, INTERPRETED=interp,
        EVEN=h % block_k == 0 and i % block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pair_out = torch.empty(n, h, dtype=dtype, device=xq.device)
    progs = _persistent_programs(xq.device, max_blocks * -(-h // cfg.down_n), INTERPRETED_PROGRAMS)
    FK.down_fp8_sorted_kernel[(progs,)](
        mid_q, mid_s, w_down, w_down_scale, layout.sorted_pairs, layout.block_expert, layout.num_blocks, wts,
        pair_out, n, i, h,
        mid_q.stride(0), mid_s.stride(0), w_down.stride(0), w_down.stride(1), w_down_scale.stride(0),
        w_down_scale.stride(1), w_down_scale.stride(2), pair_out.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=block_k, NUM_PROGRAMS=progs,
        INTERPRETED=interp, EVEN=i % block_k == 0 and h % cfg.down_n == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return pair_out


@torch.library.custom_op("autodeploy::triton_moe_experts_fp8", mutates_args=())
def triton_moe_experts_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                           w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, block_n: int,
                           block_k: int, activation: str = "silu") -> torch.Tensor:
    """W8A8 fused experts on Triton kernels (same contract as torch_moe_experts_fp8)."""
    return fused_moe_fp8(x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale, block_n, block_k,
                         activation=activation)


@triton_moe_experts_fp8.register_fake
def _(x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale, block_n, block_k, activation="silu"):
    check_moe_fp8_inputs("triton_moe_experts_fp8", x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale,
                         block_n, block_k, activation)
    return x.new_empty(x.shape)


__all__ = ["check_moe_fp8_inputs", "dequantize_experts", "fused_moe_fp8", "moe_experts_fp8_emulated",
           "torch_moe_experts_fp8", "triton_moe_experts_fp8"]
