"""`torch.ops.autodeploy.triton_mla_with_cache` and its descriptor `TritonMLABackend` ("triton").

Same contract as the torch reference op (torch_backend.py): append the step's tokens to the paged
latent cache, then attend — prefill tokens causally over (cached prefix + new tokens), decode
tokens over their whole history — for a mixed flat batch in one call. See docs/triton_backend.md.

Plan of one call (host decisions read only `*_host` metadata; nothing syncs the device):

1. `append_kernel` over the step's real tokens.
2. Prefill part (if any): the cost rule `choose_prefill_path` picks
   - "expand": gather the prefill sequences' history, K/V = latent @ kv_b_proj^T (one GEMM), then
     `expanded_prefill_kernel` (FlashAttention-style) writes the output directly; or
   - "absorb": the prefill tokens join the absorbed path below.
3. Absorbed tokens (decode tokens, plus prefill tokens on the "absorb" path): q_abs = q_nope·W_kn
   (bmm), `absorbed_attn_kernel` (+ `split_reduce_kernel` when split-K), out = latent·W_v (bmm).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from ..backend_registry import CheckResult, DeviceInfo, MLABackend, parse_version, register_backend
from ..cached_op_checks import cached_op_fake, check_cached_inputs
from ..mla_dims import MLADims, MLAShapeError, resolve_scale

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

# ----------------------------------------------------------------------------- limits (check())
#: Largest latent / rope width one program holds in registers (the accumulator is [rows, R] fp32).
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256
#: Largest head dims of the expanded prefill kernel; above them prefill always takes "absorb".
MAX_EXPAND_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def validate_dims(dims: MLADims, dtype: torch.dtype) -> Optional[str]:
    """Why these dims/dtype cannot run on the Triton kernels (None = they can)."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} unsupported (expected one of float16, bfloat16, float32)"
    if not 1 <= dims.kv_lora_rank <= MAX_KV_LORA_RANK:
        return (f"kv_lora_rank R={dims.kv_lora_rank} outside [1, {MAX_KV_LORA_RANK}] "
                "(the absorbed kernel keeps a [rows, R] fp32 accumulator in registers)")
    if dims.qk_rope_head_dim > MAX_ROPE_DIM:
        return f"qk_rope_head_dim Dr={dims.qk_rope_head_dim} over {MAX_ROPE_DIM}"
    return None


def expansion_supported(dims: MLADims) -> bool:
    return max(dims.qk_nope_head_dim, dims.v_head_dim) <= MAX_EXPAND_HEAD_DIM


# ----------------------------------------------------------------------------- cost rule
#: How many times more FLOP/s the expanded path sustains than the absorbed one on H200 (bf16):
#: expansion is one cuBLAS GEMM + a FlashAttention kernel on wgmma tiles with head dims <= 256; the
#: absorbed kernel carries a [rows, R] fp32 accumulator and reaches ~100 TFLOP/s. Measured ratio
#: 3.3-4.3 (docs/benchmarks/mla_kernels.md, prefill T=128/2048); 3 is the conservative end.
ABSORB_SLOWDOWN = 3.0


def prefill_costs(dims: MLADims, new_tokens: int, prefix_tokens: int, causal_pairs: int) -> tuple[float, float]:
    """(expand, absorb) FLOPs per head / 2 of one step's prefill part (docs/triton_backend.md).

    Per (query, key) pair the expanded attention costs Dn+Dr+Dv multiply-adds, the absorbed one
    2R+Dr. Expansion also runs kv_b_proj over every history token (R·(Dn+Dv) per token: prefix P and
    new T), absorption runs q_abs and W_v over the new tokens only (the same R·(Dn+Dv) per token).
    """
    r, dn, dv, dr = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim, dims.qk_rope_head_dim
    proj = r * (dn + dv)
    expand = (prefix_tokens + new_tokens) * proj + causal_pairs * (dn + dr + dv)
    absorb = new_tokens * proj + causal_pairs * (2 * r + dr)
    return float(expand), float(absorb)


def choose_prefill_path(dims: MLADims, new_tokens: int, prefix_tokens: int, causal_pairs: int) -> str:
    """'expand' or 'absorb' for the prefill part of a step: expand iff
        FLOPs_expand < ABSORB_SLOWDOWN * FLOPs_absorb        (prefill_costs).
    A fresh prefill (P = 0) always expands (2R+Dr > Dn+Dr+Dv for every MLA model). A chunk of T new
    tokens on a long prefix P (pairs ~ T·P) expands iff T > R(Dn+Dv) / (k(2R+Dr) - (Dn+Dr+Dv)) with
    k = ABSORB_SLOWDOWN: 45 tokens for DeepSeek-V3, 33 Mistral-Small-4, 83 GLM-4.7-Flash, 22 MiniCPM3
    (171 / 154 / 398 / 85 on raw FLOPs, k = 1). Decode-like chunks stay absorbed: expanding a long
    prefix for a few queries is mostly the kv_b_proj GEMM over the whole history.
    """
    if not expansion_supported(dims):
        return "absorb"
    expand, absorb = prefill_costs(dims, new_tokens, prefix_tokens, causal_pairs)
    return "expand" if expand < ABSORB_SLOWDOWN * absorb else "absorb"


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class AbsorbedConfig:
    block_h: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def _pow2(x: int, lo: int = 16) -> int:
    """Next power of two >= x, at least `lo` (tl.dot needs dims >= 16 when compiled)."""
    return max(lo, 1 << (max(1, x) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Split-K policy: split a launch until it has about this many programs per SM ...
SPLIT_PROGRAMS_PER_SM = 4
#: ... but never into chunks shorter than this many kv positions (per-chunk overhead + reduce).
#: H200 sweep: B=1 kv=8192 best at 64 splits, B=8 kv=2048 at 16 (docs/benchmarks/mla_kernels.md).
MIN_SPLIT_CHUNK = 128


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a few programs, so split-K paths get exercised on CPU too
    return SPLIT_PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(dims: MLADims, dtype: torch.dtype) -> AbsorbedConfig:
    """One query token x BLOCK_H heads per program. BLOCK_H=64 lets Triton use Hopper wgmma (many
    heads: compute-heavy); 16/32 keep the wasted rows of small N low (memory-bound). Every choice
    compiles for sm_90 without spills (ptxas); each is the fastest of the H200 sweep for its class
    (`bench_mla_kernels.py --tune`, docs/benchmarks/mla_kernels.md). Large KV tiles (64 tokens) and
    3 stages keep more bytes in flight, which is what these memory-bound loops need."""
    n, r = dims.num_heads, dims.kv_lora_rank
    if r > 256:
        if n > 32:
            return AbsorbedConfig(64, 1, 32, 8, 3)
        if n <= 16:
            return AbsorbedConfig(16, 1, 64, 8, 3)
        return AbsorbedConfig(32, 1, 64, 8, 3)
    if n <= 16:
        return AbsorbedConfig(16, 1, 64, 8, 2)
    if n <= 32:
        return AbsorbedConfig(32, 1, 64, 8, 2)
    return AbsorbedConfig(64, 1, 64, 8, 2)


def absorb_prefill_config(dims: MLADims, dtype: torch.dtype) -> AbsorbedConfig:
    """BLOCK_Q query tokens x BLOCK_H heads (64 rows) per program: every row shares each KV tile."""
    block_h = min(_pow2(dims.num_heads), 64)
    return AbsorbedConfig(block_h, 64 // block_h, 32, 8, 2)


def expand_config(dims: MLADims, dtype: torch.dtype, programs_at_128: Optional[int] = None,
                  num_sms: int = 132) -> ExpandConfig:
    """FlashAttention tiles for the expanded prefill (H200 sweep, T=2048). `programs_at_128`: the
    grid size with 128-query blocks; below one wave (short prefills of few heads, e.g. GLM T=128:
    20 programs) use 64-query blocks, which double the programs."""
    dmax = max(_pow2(dims.qk_nope_head_dim), _pow2(dims.v_head_dim))
    small = programs_at_128 is not None and programs_at_128 < num_sms
    if dmax <= 128:
        return ExpandConfig(64, 64, 4, 2) if small else ExpandConfig(128, 64, 8, 2)
    return ExpandConfig(64, 32, 4, 3) if small else ExpandConfig(128, 32, 8, 3)


#: Tests set this to fill every intermediate/output buffer with NaN before the kernels run, so an
#: element a kernel forgets to write shows up as NaN in the result.
POISON_BUFFERS = False


def _empty(*shape, dtype, device) -> torch.Tensor:
    if POISON_BUFFERS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def _dot_prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"  # exact fp32 products (no tf32), as the reference computes
    return "upcast" if _interpreting() else "tf32"  # "tf32" is ignored for 16-bit operands


def _capturing() -> bool:
    """True while a CUDA graph is being captured (then only static bounds may size the grid)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _split_plan(progs: int, kv_bound: int, block_n: int, forced: int, device: torch.device,
                min_chunk: int) -> tuple[int, int]:
    """(num_splits, chunk) covering kv positions [0, kv_bound) in `num_splits` chunks of `chunk`."""
    kv_bound = max(1, kv_bound)
    if forced > 0:
        splits = forced
    else:
        splits = min(-(-_target_programs(device) // max(1, progs)), -(-kv_bound // min_chunk))
    splits = max(1, min(splits, -(-kv_bound // block_n)))
    chunk = -(-(-(-kv_bound // splits)) // block_n) * block_n
    return -(-kv_bound // chunk), chunk


def _min_chunk(device: torch.device) -> int:
    return MIN_SPLIT_CHUNK if device.type == "cuda" else 4


# ----------------------------------------------------------------------------- launchers
def _launch_append(compressed_kv, kpe, mla_cache, cache_loc, num_tok, dims):
    r, dr = dims.kv_lora_rank, dims.qk_rope_head_dim
    block_t = 16
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    K.append_kernel[(triton.cdiv(num_tok, block_t),)](
        compressed_kv, kpe, flat, cache_loc, num_tok,
        compressed_kv.stride(1), kpe.stride(1), flat.stride(0),
        R=r, DR=dr, BLOCK_T=block_t, BLOCK_R=_pow2(r), BLOCK_DR=_pow2(dr), num_warps=4,
    )


#: (kernel config, dims, dtype, device, page size) whose SPLIT and non-SPLIT variants are loaded.
_WARMED: set = set()


def _launch_absorbed(q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len, latent,
                     *, seq_base, n_seqs, tok_base, n_tok, abs_base, max_q, kv_bound, cfg, dims,
                     qk_scale, forced_splits):
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    num_hb = triton.cdiv(n, cfg.block_h)
    num_qb = triton.cdiv(max_q, cfg.block_q)
    dev = q_abs.device
    splits, chunk = _split_plan(n_seqs * num_hb * num_qb, kv_bound, cfg.block_n, forced_splits, dev,
                                _min_chunk(dev))
    split = splits > 1
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    page_size = mla_cache.shape[1]
    meta = dict(
        N=n, R=r, DR=dr, PAGE_SIZE=page_size, NUM_HB=num_hb, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, BLOCK_R=_pow2(r), BLOCK_DR=_pow2(dr),
        DOT_PREC=_dot_prec(q_abs.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    reduce_meta = dict(R=r, BLOCK_R=_pow2(r), num_warps=4 if r <= 256 else 8)

    def args(part_acc, part_lse):
        is_split = part_acc is not latent
        pa = part_acc.stride()[:3] if is_split else (0, 0, 0)
        pl = part_lse.stride()[:2] if is_split else (0, 0)
        attn = (q_abs, q_pe, flat, page_table, cu_seqlen, input_pos, seq_len, latent, part_acc, part_lse,
                seq_base, tok_base, abs_base, chunk, qk_scale,
                q_abs.stride(0), q_abs.stride(1), q_pe.stride(1), q_pe.stride(2),
                flat.stride(0), page_table.stride(0), latent.stride(0), latent.stride(1), *pa, *pl)
        red = (part_acc, part_lse, latent, tok_base, abs_base, splits, *pa, *pl, latent.stride(0), latent.stride(1))
        return attn, red

    if dev.type == "cuda" and not _capturing():
        # Load both variants (SPLIT or not) now, in eager mode: a decode step captured into a CUDA
        # graph later plans its splits from the static capacity and may need the other variant,
        # and loading a kernel module while a stream is capturing is not allowed.
        key = (cfg, dims, q_abs.dtype, dev, page_size)
        if key not in _WARMED:
            dummy_acc = torch.empty(1, n, 2, r, dtype=torch.float32, device=dev)
            dummy_lse = torch.empty(1, n, 2, dtype=torch.float32, device=dev)
            for pa_, pl_, sp in ((latent, latent, False), (dummy_acc, dummy_lse, True)):
                a_attn, a_red = args(pa_, pl_)
                K.absorbed_attn_kernel.warmup(*a_attn, SPLIT=sp, grid=(1,), **meta).run  # noqa: B018
                if sp:
                    K.split_reduce_kernel.warmup(*a_red, grid=(1,), **reduce_meta).run  # noqa: B018
            _WARMED.add(key)

    if split:
        part_acc = _empty(n_tok, n, splits, r, dtype=torch.float32, device=dev)
        part_lse = _empty(n_tok, n, splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_lse = latent  # unused
    a_attn, a_red = args(part_acc, part_lse)
    K.absorbed_attn_kernel[(num_hb * num_qb, n_seqs, splits)](*a_attn, SPLIT=split, **meta)
    if split:
        K.split_reduce_kernel[(n_tok, n)](*a_red, **reduce_meta)
    return splits


def _prefill_expanded(q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos, seq_len,
                      out, *, n_pre, max_q, max_kv, total_kv, dims, qk_scale):
    n, dn, dv, r, dr = (dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank,
                        dims.qk_rope_head_dim)
    dev = q_nope.device
    w = r + dr
    kv_cu = torch.zeros(n_pre + 1, dtype=torch.int32, device=dev)
    torch.cumsum(seq_len[:n_pre], 0, dtype=torch.int32, out=kv_cu[1:])
    lat = _empty(total_kv, w, dtype=mla_cache.dtype, device=dev)
    flat = mla_cache.view(-1, w)
    block_t = 32
    K.gather_kv_kernel[(triton.cdiv(max_kv, block_t), n_pre)](
        flat, page_table, seq_len, kv_cu, lat, flat.stride(0), page_table.stride(0), lat.stride(0),
        W=w, PAGE_SIZE=mla_cache.shape[1], BLOCK_T=block_t, BLOCK_W=min(256, _pow2(w)), num_warps=4,
    )
    kv = torch.matmul(lat[:, :r], kv_b_proj_weight.t())  # [total_kv, N*(Dn+Dv)]: K_nope | V per head
    sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 132
    cfg = expand_config(dims, q_nope.dtype, triton.cdiv(max_q, 128) * n * n_pre, sms)
    bm, bn = cfg.block_m, cfg.block_n
    K.expanded_prefill_kernel[(triton.cdiv(max_q, bm), n, n_pre)](
        q_nope, q_pe, kv, lat, cu_seqlen, input_pos, kv_cu, out, qk_scale,
        q_nope.stride(1), q_nope.stride(2), q_pe.stride(1), q_pe.stride(2),
        kv.stride(0), lat.stride(0), out.stride(1), out.stride(2),
        DN=dn, DV=dv, DR=dr, R=r, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DN=_pow2(dn), BLOCK_DV=_pow2(dv), BLOCK_DR=_pow2(dr),
        DOT_PREC=_dot_prec(q_nope.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _prefill_shape(cu_seqlen_host, input_pos_host, n_pre: int) -> tuple[int, int, int]:
    """(new tokens, cached prefix tokens, causal (query, key) pairs) of the prefill seqs, from host data."""
    q = (cu_seqlen_host[1 : n_pre + 1] - cu_seqlen_host[:n_pre]).long()
    p = input_pos_host[:n_pre].long()
    pairs = (q * p + q * (q + 1) // 2).sum()
    return int(q.sum()), int(p.sum()), int(pairs)


@torch.library.custom_op("autodeploy::triton_mla_with_cache", mutates_args=("mla_cache",))
def triton_mla_with_cache(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    batch_info_host: torch.Tensor,
    max_seq_info_host: torch.Tensor,
    cu_seqlen_host: torch.Tensor,
    input_pos_host: torch.Tensor,
    cu_seqlen: torch.Tensor,
    input_pos: torch.Tensor,
    seq_len_with_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_loc: torch.Tensor,
    mla_cache: torch.Tensor,
    scale: Optional[float] = None,
    prefill_mode: str = "auto",
    decode_splits: int = 0,
) -> torch.Tensor:
    """Append the step's tokens to the paged cache, then attend. Returns [1, T, N, Dv].

    `prefill_mode` ("auto" | "expand" | "absorb") and `decode_splits` (0 = auto, k >= 1 forces k
    split-K chunks, also for absorbed prefill) are for tests and benchmarks; graphs use the defaults.
    """
    dims = check_cached_inputs(OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache)
    if not HAS_TRITON:
        raise RuntimeError(f"{OP}: triton is not installed ({_TRITON_IMPORT_ERROR}); "
                           "install triton>=3.4 or pick another MLA backend (e.g. 'torch').")
    why = validate_dims(dims, q_nope.dtype)
    if why:
        raise MLAShapeError(f"{OP}: {why}. The descriptor's check() refuses these dims; use another backend.")
    if prefill_mode not in ("auto", "expand", "absorb"):
        raise ValueError(f"{OP}: prefill_mode={prefill_mode!r}; expected 'auto', 'expand' or 'absorb'.")
    if prefill_mode == "expand" and not expansion_supported(dims):
        raise MLAShapeError(f"{OP}: prefill_mode='expand' needs Dn, Dv <= {MAX_EXPAND_HEAD_DIM}, got "
                            f"Dn={dims.qk_nope_head_dim}, Dv={dims.v_head_dim}; use 'auto' or 'absorb'.")
    for name, t in (("compressed_kv", compressed_kv), ("kpe", kpe), ("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1:
            raise MLAShapeError(f"{OP}: {name} must have a unit stride in its last dim, got strides {t.stride()}.")
    if not mla_cache.is_contiguous():
        raise MLAShapeError(f"{OP}: mla_cache must be contiguous [num_pages, page_size, R+Dr].")

    n, dn, dv, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    t_all = q_nope.shape[1]
    out = _empty(1, t_all, n, dv, dtype=q_nope.dtype, device=q_nope.device)
    n_pre, n_pre_tok, n_dec = (int(x) for x in batch_info_host.tolist())  # host tensor: no sync
    max_q, max_kv = (int(x) for x in max_seq_info_host.tolist())
    num_tok = n_pre_tok + n_dec
    if num_tok < t_all:
        out[:, num_tok:].zero_()  # padded tokens: finite
    if num_tok == 0:
        return out

    _launch_append(compressed_kv, kpe, mla_cache, cache_loc, num_tok, dims)
    qk_scale = resolve_scale(dims, scale) * LOG2E

    mode = None
    total_kv = 0
    if n_pre > 0:
        new_tok, prefix, pairs = _prefill_shape(cu_seqlen_host, input_pos_host, n_pre)
        total_kv = new_tok + prefix
        mode = choose_prefill_path(dims, new_tok, prefix, pairs) if prefill_mode == "auto" else prefill_mode

    abs_lo = 0 if mode == "absorb" else n_pre_tok
    if abs_lo < num_tok:
        w = kv_b_proj_weight.view(n, dn + dv, r)
        q_abs = torch.bmm(q_nope[0, abs_lo:num_tok].transpose(0, 1), w[:, :dn])  # [N, Ta, R]
        latent = _empty(*q_abs.shape, dtype=q_abs.dtype, device=q_abs.device)
        if mode == "absorb":
            _launch_absorbed(
                q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                seq_base=0, n_seqs=n_pre, tok_base=0, n_tok=n_pre_tok, abs_base=abs_lo, max_q=max_q,
                kv_bound=max_kv, cfg=absorb_prefill_config(dims, q_nope.dtype), dims=dims,
                qk_scale=qk_scale, forced_splits=decode_splits,
            )
        if n_dec > 0:
            # Decode grid: from host batch_info (fixed per captured graph) and, under CUDA-graph
            # capture, a split count from the static cache capacity (page-table width), so a replay
            # stays correct while sequences grow; kernels skip chunks past each sequence's length.
            static_kv = page_table.shape[1] * mla_cache.shape[1]
            kv_bound = static_kv if _capturing() else min(max_kv, static_kv)
            _launch_absorbed(
                q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                seq_base=n_pre, n_seqs=n_dec, tok_base=n_pre_tok, n_tok=n_dec, abs_base=abs_lo, max_q=1,
                kv_bound=kv_bound, cfg=decode_config(dims, q_nope.dtype), dims=dims,
                qk_scale=qk_scale, forced_splits=decode_splits,
            )
        o = torch.bmm(latent, w[:, dn:].transpose(1, 2))  # [N, Ta, Dv]
        out[0, abs_lo:num_tok].copy_(o.transpose(0, 1))
    if mode == "expand":
        _prefill_expanded(
            q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos, seq_len_with_cache,
            out, n_pre=n_pre, max_q=max_q, max_kv=max_kv, total_kv=total_kv, dims=dims, qk_scale=qk_scale,
        )
    return out


triton_mla_with_cache.register_fake(cached_op_fake(OP, METADATA))


# ----------------------------------------------------------------------------- descriptor
@register_backend
class TritonMLABackend(MLABackend):
    name = "triton"
    cached_op = torch.ops.autodeploy.triton_mla_with_cache
    metadata = METADATA
    source = "autodeploy_mla Triton kernels (docs/triton_backend.md; H200 numbers in docs/benchmarks/mla_kernels.md)"
    # Decode grids come from host batch_info (fixed per captured batch size) and a split count from
    # the static page-table width under capture; kernels read lengths from device metadata.
    # Verified by tests/test_triton_mla.py::test_cuda_graph_decode_replays_as_sequences_grow (GPU).
    decode_graph_safe = True

    def check(
        self,
        dims: MLADims,
        dtype: torch.dtype,
        device: DeviceInfo,
        versions: Mapping[str, Optional[str]],
        page_size: int,
    ) -> CheckResult:
        tv = versions.get("triton")
        if tv is None or not HAS_TRITON:
            extra = f" (import failed: {_TRITON_IMPORT_ERROR})" if tv is not None else ""
            return CheckResult(False, f"triton not installed{extra}; pip install 'triton>=3.4'")
        if (parse_version(tv) or (0, 0, 0)) < (3, 4, 0):
            return CheckResult(False, f"triton {tv} is older than 3.4 (the version these kernels were tested on)")
        if device.type == "cpu":
            if not _interpreting():
                return CheckResult(False, "Triton kernels need a CUDA GPU (on CPU only through TRITON_INTERPRET=1)")
        elif device.type != "cuda":
            return CheckResult(False, f"device type {device.type!r} unsupported (CUDA only)")
        elif device.sm is not None and device.sm < 80 and dtype == torch.bfloat16:
            return CheckResult(False, f"bf16 tl.dot needs SM80+, device is {device.short()}")
        elif device.sm is not None and device.sm < 70:
            return CheckResult(False, f"needs SM70+, device is {device.short()}")
        if page_size < 1:
            return CheckResult(False, f"page_size={page_size} must be >= 1")
        why = validate_dims(dims, dtype)
        if why:
            return CheckResult(False, why)
        note = "" if expansion_supported(dims) else f"; prefill absorbed only (Dn/Dv > {MAX_EXPAND_HEAD_DIM})"
        where = "CPU interpreter (slow, for tests)" if device.type == "cpu" else device.short()
        return CheckResult(True, f"triton on {where}: any N, R<= {MAX_KV_LORA_RANK}, Dr<= {MAX_ROPE_DIM}{note}")
