"""MoE experts ops: `torch.ops.autodeploy.torch_moe_experts` (reference) and `triton_moe_experts`.

Both compute, for a flat token batch `x [T, H]` routed to `top_k` experts per token
(`topk_ids [T, k]`, `topk_weights [T, k]`), with gated experts `w_up [E, 2I, H]` ([gate; up] rows,
as HF stores `gate_up_proj`) and `w_down [E, H, I]`:

    out[t] = sum_j topk_weights[t, j] * w_down[e] @ (silu(w_up[e, :I] @ x[t]) * w_up[e, I:] @ x[t]),
             e = topk_ids[t, j]

which is what transformers' `grouped_mm` experts forward computes (sort, gather, two grouped GEMMs,
gate, weighted un-permute, sum over k). The `fuse_moe` pass rewrites that subgraph into one of
these ops. Weights may be any strided view of those shapes (transposed storage included).

The reference is a dense loop over experts (every token through every expert, masked by its
routing weight): exact, vectorised, no host sync, and slow — for tests and small CPU models. The
Triton op is the fast path (kernels.py): a deterministic padded layout by expert, then two GEMM
kernels over row blocks of one expert each, with the gate fused into the first and the routing
weight into the second. At prefill sizes (`MoEConfig.sorted_tma`, SM90+, contiguous weights) the
token rows are first copied into expert order so both GEMMs load every operand by TMA descriptor.
Launch configs: `tuning.moe_config`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..triton_helpers import dot_precision, interpreting, pow2
from .tuning import MoEConfig, moe_config

try:  # Triton is optional: without it `triton_moe_experts` raises and the pass never picks it.
    from . import kernels as K

    HAS_TRITON = True
    TRITON_IMPORT_ERROR = ""
except ImportError as e:  # pragma: no cover - exercised only without triton
    K = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = str(e)

ACTIVATIONS = ("silu",)


def check_moe_inputs(name: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, activation: str) -> tuple[int, int, int, int, int]:
    """(T, k, E, H, I) of a valid call; ValueError naming the offending shape otherwise."""
    dims = check_moe_shapes(name, x, topk_ids, topk_weights, w_up, w_down, activation)
    if not (x.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"{name}: x, w_up and w_down must share a dtype, got {x.dtype}, {w_up.dtype}, "
                         f"{w_down.dtype}")
    return dims


def check_moe_shapes(name: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, activation: str) -> tuple[int, int, int, int, int]:
    """The shapes every MoE experts op takes (16-bit and FP8 alike): (T, k, E, H, I), or ValueError."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation {activation!r} unsupported; supported: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{name}: topk_ids and topk_weights must both be [T={t}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if w_up.dim() != 3 or w_up.shape[2] != h or w_up.shape[1] % 2:
        raise ValueError(f"{name}: w_up must be [E, 2I, H={h}], got {tuple(w_up.shape)}")
    e, two_i, _ = w_up.shape
    i = two_i // 2
    if tuple(w_down.shape) != (e, h, i):
        raise ValueError(f"{name}: w_down must be [E={e}, H={h}, I={i}], got {tuple(w_down.shape)}")
    return t, topk_ids.shape[1], e, h, i


# ----------------------------------------------------------------------------- reference
@torch.library.custom_op("autodeploy::torch_moe_experts", mutates_args=())
def torch_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Reference: every token through every expert, weighted by its routing weight (0 if unrouted)."""
    t, k, e, h, i = check_moe_inputs("torch_moe_experts", x, topk_ids, topk_weights, w_up, w_down, activation)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for ex in range(e):
        w = (topk_weights.float() * (topk_ids == ex)).sum(-1)  # [T]
        gu = x @ w_up[ex].t()
        hid = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        out += (hid @ w_down[ex].t()).float() * w[:, None]
    return out.to(x.dtype)


@torch_moe_experts.register_fake
def _(x, topk_ids, topk_weights, w_up, w_down, activation="silu"):
    check_moe_inputs("torch_moe_experts", x, topk_ids, topk_weights, w_up, w_down, activation)
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------- Triton
def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor, config: Optional[MoEConfig] = None, activation: str = "silu") -> torch.Tensor:
    """The Triton experts computation; `config` overrides the launch config (benchmarks, tests)."""
    if not HAS_TRITON:
        raise RuntimeError(f"triton_moe_experts needs triton ({TRITON_IMPORT_ERROR}); pip install 'triton>=3.4'")
    t, k, e, h, i = check_moe_inputs("triton_moe_experts", x, topk_ids, topk_weights, w_up, w_down, activation)
    n = t * k
    if n == 0:
        return x.new_zeros(t, h)
    cfg = config or moe_config(n, e, h, i, x.dtype, x.device.type == "cuda" and not interpreting())
    bm = cfg.block_m
    dev = x.device
    wts = topk_weights.reshape(-1)
    prec = dot_precision(x.dtype)
    # One token: its k pairs have k different experts (top-k ids are distinct), so a block per pair
    # reads each expert's weights once, as the layout would; the two layout kernels are skipped.
    pair_blocks = t == 1 and not cfg.sorted_tma
    if pair_blocks:
        sorted_pairs = block_expert = topk_ids.reshape(-1)  # the kernels read no SORTED under PAIR_BLOCKS
    else:
        layout = expert_layout(topk_ids.reshape(-1), e, cfg)
        sorted_pairs, block_expert = layout.sorted_pairs, layout.block_expert
    max_blocks = block_expert.shape[0]
    inter = torch.empty(max_blocks * bm, i, dtype=x.dtype, device=dev)
    if not pair_blocks and cfg.sorted_tma and sorted_tma_ok(x, w_up, w_down):
        pair_out = _sorted_tma_gemms(x, w_up, w_down, wts, layout, inter, cfg, n, k, h, i, prec)
        return _sum_over_topk(pair_out, topk_ids, t, k, h)
    K.up_kernel[(-(-i // cfg.up_n), max_blocks)](
        x, w_up, sorted_pairs, block_expert, inter, n, h, i,
        x.stride(0), x.stride(1), w_up.stride(0), w_up.stride(1), w_up.stride(2), inter.stride(0),
        TOP_K=k, BLOCK_M=bm, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, DOT_PREC=prec, PAIR_BLOCKS=pair_blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pair_out = torch.empty(n, h, dtype=x.dtype, device=dev)
    K.down_kernel[(-(-h // cfg.down_n), max_blocks)](
        inter, w_down, sorted_pairs, block_expert, wts, pair_out, n, i, h,
        inter.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), pair_out.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, DOT_PREC=prec, PAIR_BLOCKS=pair_blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _sum_over_topk(pair_out, topk_ids, t, k, h)


class ExpertLayout(NamedTuple):
    """The step's (token, k) pairs in expert order, in row blocks of `block_m` (kernels.place_kernel)."""

    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32: a pair index per slot, n in padding slots
    block_expert: torch.Tensor  # [max_blocks] int32: each block's expert, -1 past the last block in use
    num_blocks: torch.Tensor  # [1] int32: blocks in use (on the device: the op never reads it on the host)


def expert_layout(ids: torch.Tensor, num_experts: int, cfg: MoEConfig) -> ExpertLayout:
    """The (token, k) pairs of `ids` ([n] expert ids) in expert order, in row blocks of cfg.block_m.
    Two kernels, static grids, no host sync: per-chunk expert counts, then every program sums them
    and places its chunk's pairs and its share of the padding blocks."""
    n, bm = ids.shape[0], cfg.block_m
    e_p2 = pow2(num_experts, lo=2)
    chunk = cfg.align_chunk(e_p2)
    num_chunks = -(-n // chunk)
    max_blocks = -(-n // bm) + min(num_experts, n)
    partial = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(max_blocks * bm, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=ids.device)
    K.count_kernel[(num_chunks,)](ids, partial, n, E_P2=e_p2, CHUNK=chunk)
    K.place_kernel[(max(num_chunks, max_blocks),)](ids, partial, sorted_pairs, block_expert, num_blocks, n,
                                                   num_chunks, max_blocks, E_P2=e_p2, BLOCK_M=bm, CHUNK=chunk,
                                                   ROWS=cfg.align_rows(e_p2))
    return ExpertLayout(sorted_pairs, block_expert, num_blocks)


def _sum_over_topk(pair_out: torch.Tensor, ids: torch.Tensor, t: int, k: int, h: int) -> torch.Tensor:
    """[T*k, H] per-pair outputs -> [T, H], summed in fp32 by one Triton pass (torch's generic
    reduction over the middle dim of [T, k, H] took twice the bytes' time: 29 vs ~14 us at T=2048).
    Pairs with a negative id ([T, k] `ids`) are no pairs: the layout never placed them, so their
    rows were not written and are skipped (k = 1 too, which is why there is no shortcut for it)."""
    out = torch.empty(t, h, dtype=pair_out.dtype, device=pair_out.device)
    block_t, block_h = (4 if t >= 512 else 1), min(1024, pow2(h))
    K.topk_sum_kernel[(-(-t // block_t), -(-h // block_h))](pair_out, ids.reshape(-1), out, t, h, TOP_K=k, BLOCK_T=block_t,
                                                           BLOCK_H=block_h)
    return out


def sorted_tma_ok(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the sorted-rows/TMA path can take these operands: tensor descriptors need a dense last
    dim and 16-byte aligned rows and bases (a transposed weight view takes the gathered path)."""
    if x.device.type != "cuda" or interpreting() or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    es = x.element_size()
    return all(t.is_contiguous() and (t.shape[-1] * es) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (w_up, w_down)) and (x.shape[1] * es) % 16 == 0


def _persistent_programs(device: torch.device, tiles: int, interpreted: Optional[int] = None) -> int:
    """Programs of a persistent GEMM: one per SM (fewer when there are fewer tiles); off a compiled GPU
    (the interpreter, CPU tests) one per tile, or at most `interpreted` (so tests walk several tiles per
    program)."""
    if device.type != "cuda" or interpreting():
        return max(1, min(tiles, interpreted or tiles))
    return max(1, min(torch.cuda.get_device_properties(device).multi_processor_count, tiles))


def _sorted_tma_gemms(x, w_up, w_down, wts, layout: ExpertLayout, inter, cfg: MoEConfig, n: int, k: int,
                      h: int, i: int, prec: str) -> torch.Tensor:
    """Both GEMMs over rows copied into expert order (kernels.gather_kernel), operands by descriptor,
    persistent over the blocks in use (`layout.num_blocks`, read on the device)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm = cfg.block_m
    e = w_up.shape[0]
    max_blocks = layout.block_expert.shape[0]
    xs = torch.empty(max_blocks * bm, h, dtype=x.dtype, device=x.device)
    block_h = 128
    K.gather_kernel[(max_blocks, -(-h // block_h))](x, layout.sorted_pairs, layout.block_expert, xs, n, h,
                                                    x.stride(0), TOP_K=k, BLOCK_M=bm, BLOCK_H=block_h)
    xs_d = TensorDescriptor.from_tensor(xs, [bm, cfg.up_k])
    wu_d = TensorDescriptor.from_tensor(w_up.view(e * 2, i, h), [2, cfg.up_n, cfg.up_k])
    out_d = TensorDescriptor.from_tensor(inter, [bm, cfg.up_n])
    progs = _persistent_programs(x.device, max_blocks * -(-i // cfg.up_n))
    K.up_sorted_kernel[(progs,)](
        xs_d, wu_d, layout.block_expert, layout.num_blocks, out_d, h, i,
        BLOCK_M=bm, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs, DOT_PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    a_d = TensorDescriptor.from_tensor(inter, [bm, cfg.down_k])
    wd_d = TensorDescriptor.from_tensor(w_down.view(e * h, i), [cfg.down_n, cfg.down_k])
    pair_out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    progs = _persistent_programs(x.device, max_blocks * -(-h // cfg.down_n))
    K.down_sorted_kernel[(progs,)](
        a_d, wd_d, layout.sorted_pairs, layout.block_expert, layout.num_blocks, wts, pair_out, n, i, h,
        pair_out.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, NUM_PROGRAMS=progs,
        DOT_PREC=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pair_out


@torch.library.custom_op("autodeploy::triton_moe_experts", mutates_args=())
def triton_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Fused experts on Triton kernels (same contract as torch_moe_experts)."""
    return fused_moe(x, topk_ids, topk_weights, w_up, w_down, activation=activation)


@triton_moe_experts.register_fake
def _(x, topk_ids, topk_weights, w_up, w_down, activation="silu"):
    check_moe_inputs("triton_moe_experts", x, topk_ids, topk_weights, w_up, w_down, activation)
    return x.new_empty(x.shape)
