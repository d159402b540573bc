#!/usr/bin/env python
"""MLA kernel benchmark: the Triton backend vs FlashInfer's MLA wrapper vs the torch reference.

Decode (batch {1, 8, 32, 128} x kv_len {512, 2048, 8192}) for five dim sets, timed two ways:
  - attention core: the kernels after q_abs = q_nope·W_kn and before ·W_v (triton: absorbed kernel
    [+ split-K reduce]; FlashInfer: BatchMLAPagedAttentionWrapper.run(), plan timed separately);
  - full cached op: append + q_abs GEMM + attention + W_v GEMM (triton: the registered op;
    FlashInfer: the same GEMMs around run(); torch: the reference op, eager, skipped when huge).
GPU times are medians of triton.testing.do_bench (L2 flushed before each run) over a CUDA-graph
replay of the region (so host launch overhead is excluded, as in a captured decode step); the
full triton op is also timed eagerly. Prefill: one sequence of T {128, 512, 2048} new tokens with
and without a cached prefix, triton auto / forced expand / forced absorb vs the torch reference.

Writes <out>/mla_kernels.{md,json,png}. `--tune` instead sweeps launch configs and split policy and
writes <out>/mla_tune.json. `--smoke` runs a tiny case on whatever device exists (CPU: Triton
interpreter) to check the script itself. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import random
import sys
import time
import traceback

if __name__ == "__main__" and "--smoke" in sys.argv and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from autodeploy_mla.custom_ops import MLADims, SessionSpec, Target, get_backend  # noqa: E402
from autodeploy_mla.custom_ops.attention.mla_dims import resolve_scale  # noqa: E402
from autodeploy_mla.custom_ops.attention.step_context import using_sessions  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import TritonPolicy, tuning  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import launchers as top  # noqa: E402
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence  # noqa: E402
from autodeploy_mla.testing.scenarios import step_descriptor  # noqa: E402

COPY_TBS = 4.3  # measured H200 device copy bandwidth, TB/s (DESIGN §12)
BF16_TFLOPS = 790.0  # measured bf16 dense matmul, TFLOP/s

DIMS = {
    "deepseek_v3_n128": MLADims(128, 128, 64, 128, 512),
    "deepseek_v3_tp2_n64": MLADims(64, 128, 64, 128, 512),
    "deepseek_v3_tp8_n16": MLADims(16, 128, 64, 128, 512),
    "mistral_small_4_n32": MLADims(32, 64, 64, 128, 256),
    "glm_4_7_flash_n20": MLADims(20, 192, 64, 256, 512),
    "minicpm3_n40": MLADims(40, 64, 32, 64, 256),
}
BATCHES = (1, 8, 32, 128)
KV_LENS = (512, 2048, 8192)
PREFILL_T = (128, 512, 2048)
PREFILL_PREFIX = (0, 4096)
PAGE = 64
TORCH_DECODE_MAX_TOKENS = 128 * 2048  # reference gathers the whole history in fp32: skip beyond
TORCH_PREFILL_MAX_SCORE_BYTES = 2 << 30  # reference materialises [N, T, kv] fp32 scores
# FlashInfer 0.6.x MLA: only (R, Dr) = (512, 64) is known to work; R=256 crashed the CUDA context
# (DESIGN §8). Never launch it on anything else.


def flashinfer_accepts(d: MLADims, dtype=torch.bfloat16) -> tuple[bool, str]:
    """Whether the installed FlashInfer's capability facts (the backend's check) accept these dims on
    this GPU: 0.7.x serves R = 256 too; never launched outside them."""
    be = get_backend("flashinfer_mla")
    res = be.check(d, dtype, Target.detect("cuda", PAGE))
    return res.ok, res.reason


# ----------------------------------------------------------------------------- timing
#: How L2 is emptied before each timed run. "zero": triton.testing.do_bench's own flush (it zeroes a
#: 256 MB buffer, which leaves L2 full of dirty lines: the timed kernel's first reads pay their write-back,
#: ~9.5 us of a streaming kernel's time on the H200, docs/benchmarks/read_floor.md). "read": a read of a
#: 256 MB buffer instead (L2 left holding clean lines of other data: cold, with nothing to write back, as
#: a decode step's attention finds it after small GEMMs).
FLUSH_MODES = ("zero", "read")


def _do_bench(fn, rep_ms: float, flush: str = "zero") -> float:
    import triton.testing

    if flush == "zero":
        return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")) * 1e3
    if flush != "read":
        raise ValueError(f"flush mode {flush!r}: expected one of {FLUSH_MODES}")
    buf = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, as do_bench's

    def clear():
        buf.sum()

    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        clear()
        fn()
    t1.record()
    torch.cuda.synchronize()
    est = max(t0.elapsed_time(t1) / 5, 1e-3)
    for _ in range(max(1, int(max(5, rep_ms // 4) / est))):
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        clear()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2] * 1e3


def time_us(fn, *, graph: bool, rep_ms: float = 40, flush: str = "zero") -> tuple[float, str]:
    """Median µs of fn; on CUDA with graph=True, of a CUDA-graph replay of fn. Returns (µs, how).
    `flush`: how L2 is emptied before each run (FLUSH_MODES)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "cpu-wall"
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return _do_bench(g.replay, rep_ms, flush), "graph"
        except Exception as e:  # fall back to eager, but say so
            torch.cuda.synchronize()
            return _do_bench(fn, rep_ms, flush), f"eager (graph capture failed: {type(e).__name__})"
    return _do_bench(fn, rep_ms, flush), "eager"


def host_ms(fn, n: int = 10) -> float:
    ts = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


# ----------------------------------------------------------------------------- cases
class Case:
    """One step (decode batch or one prefill sequence) over a random, page-shuffled paged cache."""

    def __init__(self, dims: MLADims, seqs: list[tuple[int, int]], dtype, device, seed: int = 0):
        # seqs: (cached tokens, new tokens) per sequence
        self.dims, self.dtype, self.device = dims, dtype, device
        g = torch.Generator(device="cpu").manual_seed(seed)
        max_len = max(c + n for c, n in seqs)
        self.pages_per_seq = math.ceil(max_len / PAGE)
        num_pages = 1 + self.pages_per_seq * len(seqs)
        alloc = PageAllocator(num_pages, PAGE, self.pages_per_seq)
        random.Random(seed).shuffle(alloc._free)
        alloc.ensure_many({i: c + n for i, (c, n) in enumerate(seqs)})
        n_tok = sum(n for _, n in seqs)
        self.info = SequenceInfo(len(seqs), n_tok, max_len, PAGE, device)
        self.info.prepare_step([StepSequence(i, [0] * n, c) for i, (c, n) in enumerate(seqs)], alloc.pages_of)
        self.seqs = seqs
        self.num_tokens = n_tok
        N, dn, dr, dv, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

        # Random cache (never zeros): prefixes are "already cached" tokens.
        self.cache = torch.randn(num_pages, PAGE, r + dr, device=device, dtype=torch.float32).to(dtype)
        self.x = [rnd(1, n_tok, N, dn), rnd(1, n_tok, N, dr), rnd(1, n_tok, r), rnd(1, n_tok, 1, dr)]
        self.w = rnd(N * (dn + dv), r, scale=r**-0.5)
        self.scale = resolve_scale(dims, None)

    @contextlib.contextmanager
    def op(self, backend: str, policy=None):
        """The backend's cached op on this step as a no-argument callable, run as in a model: a session
        of its own (`policy`, e.g. TritonPolicy(prefill_mode="expand")) is prepared for the step and
        active while the block runs (outside the timed calls)."""
        be = get_backend(backend)
        info = self.info
        dev = torch.device(self.device)
        spec = SessionSpec((self.dims,), self.dtype, dev, Target.detect(dev, info.page_size), info.max_batch_size,
                           info.max_num_tokens, info.max_pages_per_seq)
        sess = be.setup(spec, policy)
        sess.prepare(info, step_descriptor(info))
        meta = [info.get(m) for m in be.metadata]
        with using_sessions({backend: sess}):
            yield lambda: be.cached_op(*self.x, self.w, *meta, self.cache, None)

    @property
    def kv_tokens(self) -> int:
        return sum(c + n for c, n in self.seqs)


def decode_core_triton(case: Case, cfg=None, forced_splits: int = 0):
    d = case.dims
    N, dn, r = d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
    w = case.w.view(N, dn + d.v_head_dim, r)
    q_abs = torch.bmm(case.x[0][0].transpose(0, 1), w[:, :dn])
    latent = torch.empty_like(q_abs)
    info = case.info
    B = len(case.seqs)
    kv = max(c + n for c, n in case.seqs)
    # cfg None: what the op runs (the Gluon decode kernel where TritonPolicy.decode_kernel="auto" picks it)
    call = top.OpCall(TritonPolicy(decode_splits=forced_splits), warmed=set())
    gluon = cfg is None and top.gluon_decode_choice(call, tuning.decode_config(d, case.dtype, case.cache.dtype), d,
                                                     q_abs.dtype, case.cache, torch.device(case.device), False)
    cfg = cfg or tuning.decode_config(d, case.dtype, case.cache.dtype)
    top.launch_append(case.x[2], case.x[3], case.cache, info.get("cache_loc"), B, d)

    used: list[int] = []

    def run():
        if gluon:
            got = top.launch_gluon_decode(
                call, q_abs, case.x[1], case.cache, info.get("page_table"), info.get("cu_seqlen"),
                info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=B, tok_base=0, abs_base=0, kv_bound=kv,
                dims=d, qk_scale=case.scale * top.LOG2E)
            if got:
                used.append(got)
                return
        used.append(top.launch_absorbed(
            call, q_abs, case.x[1], case.cache, info.get("page_table"), info.get("cu_seqlen"), info.get("input_pos"),
            info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=B, tok_base=0, n_tok=B, abs_base=0,
            max_q=1, kv_bound=kv, cfg=cfg, dims=d, qk_scale=case.scale * top.LOG2E,
        ))

    def splits():  # the count the launcher plans (split_plan or split_plan_waves), from one eager call
        run()
        return used[-1]

    run.kernel = "gluon" if gluon else "tl"  # what the default core ran (bench_decode's layout column)

    return run, q_abs, latent, splits()


class FlashInferDecode:
    """FlashInfer BatchMLAPagedAttentionWrapper on the shared paged cache ([..., :R] / [..., R:] views)."""

    def __init__(self, case: Case, q_abs: torch.Tensor):
        import flashinfer

        d = case.dims
        B = len(case.seqs)
        self.case = case
        self.ws = torch.empty(128 << 20, dtype=torch.uint8, device=case.device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.ws, backend="auto")
        pt_host = case.info.get("page_table_host")
        pps = case.pages_per_seq
        kv = torch.tensor([c + n for c, n in case.seqs], dtype=torch.int32)
        self.plan_args = (
            torch.arange(B + 1, dtype=torch.int32),
            torch.arange(B + 1, dtype=torch.int32) * pps,
            pt_host[:B, :pps].reshape(-1).to(case.device),
            kv,
            d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim, PAGE, False, case.scale, case.dtype, case.dtype,
        )
        self.plan()
        self.q = q_abs.transpose(0, 1).contiguous()  # [B, N, R]
        self.q_pe = case.x[1][0].contiguous()  # [B, N, Dr]
        self.out = torch.empty_like(self.q)
        r = d.kv_lora_rank
        self.ckv, self.kpe = case.cache[..., :r], case.cache[..., r:]

    def plan(self):
        self.wrapper.plan(*self.plan_args)

    def run(self):
        self.wrapper.run(self.q, self.q_pe, self.ckv, self.kpe, out=self.out)

    def full(self):
        """append + q_abs GEMM + run + W_v GEMM, the same work as the triton op around its kernel."""
        case, d = self.case, self.case.dims
        N, dn, r = d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
        w = case.w.view(N, dn + d.v_head_dim, r)
        out = torch.empty(1, case.num_tokens, N, d.v_head_dim, device=case.device, dtype=case.dtype)

        def run():
            flat = case.cache.view(-1, case.cache.shape[-1])
            new = torch.cat([case.x[2][0], case.x[3][0, :, 0]], dim=-1)
            flat.index_copy_(0, case.info.get("cache_loc")[: case.num_tokens].long(), new)
            q = torch.bmm(case.x[0][0].transpose(0, 1), w[:, :dn]).transpose(0, 1)
            self.q.copy_(q)
            self.wrapper.run(self.q, self.q_pe, self.ckv, self.kpe, out=self.out)
            o = torch.bmm(self.out.transpose(0, 1), w[:, dn:].transpose(1, 2))
            out[0].copy_(o.transpose(0, 1))

        return run


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def bench_decode(dims_name: str, d: MLADims, B: int, kv: int, dtype, dev, rep_ms: float, with_fi: bool,
                 flush: str = "zero") -> dict:
    row: dict = {"kind": "decode", "dims": dims_name, "N": d.num_heads, "R": d.kv_lora_rank,
                 "Dr": d.qk_rope_head_dim, "Dn": d.qk_nope_head_dim, "Dv": d.v_head_dim, "batch": B, "kv_len": kv}
    case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=B * 7 + kv)
    bytes_kv = B * kv * (d.kv_lora_rank + d.qk_rope_head_dim) * case.cache.element_size()
    flops = 2.0 * B * d.num_heads * kv * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
    row["bytes"], row["flops"] = bytes_kv, flops
    try:
        run, q_abs, latent, splits = decode_core_triton(case)
        row["triton_splits"], row["triton_kernel"] = splits, run.kernel
        row["triton_core_us"], row["triton_core_how"] = time_us(run, graph=True, rep_ms=rep_ms, flush=flush)
        ref_latent = None
        if with_fi or B * kv <= 8 * 2048:
            run()
            ref_latent = latent.clone()
    except Exception as e:
        row["triton_core_err"] = _err(e)
        traceback.print_exc()
        ref_latent = None
    # A/B of the two decode kernels (the default is one of them): heads on the MMA's M or N side
    for layout, key in (("heads_on_m", "triton_m_core_us"), ("heads_on_n", "triton_n_core_us")):
        cfg = tuning.decode_config(d, dtype, case.cache.dtype, layout)
        if layout == "heads_on_n" and not cfg.heads_on_n:
            continue
        try:
            run_l, *_ = decode_core_triton(case, cfg)
            row[key], _ = time_us(run_l, graph=True, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row[key.replace("_us", "_err")] = _err(e)
    row["triton_layout"] = "heads_on_n" if tuning.decode_config(d, dtype, case.cache.dtype).heads_on_n else "heads_on_m"
    if row.get("triton_kernel") == "gluon":
        row["triton_layout"] = "gluon"
    try:
        with case.op("triton") as op:
            row["triton_op_us"], row["triton_op_how"] = time_us(op, graph=True, rep_ms=rep_ms, flush=flush)
            row["triton_op_eager_us"], _ = time_us(op, graph=False, rep_ms=rep_ms, flush=flush)
    except Exception as e:
        row["triton_op_err"] = _err(e)
        traceback.print_exc()
    fi_ok, fi_why = flashinfer_accepts(d) if with_fi else (False, "")
    if fi_ok:
        try:
            fi = FlashInferDecode(case, q_abs)
            row["fi_plan_ms"] = host_ms(fi.plan)
            fi.plan()
            row["fi_core_us"], row["fi_core_how"] = time_us(fi.run, graph=True, rep_ms=rep_ms, flush=flush)
            fi.run()
            torch.cuda.synchronize()
            if ref_latent is not None:  # both compute the same latent: cross-check
                row["fi_vs_triton_rel"] = float((fi.out.transpose(0, 1).float() - ref_latent.float()).abs().max()
                                                / ref_latent.float().abs().max())
            row["fi_op_us"], row["fi_op_how"] = time_us(fi.full(), graph=True, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row["fi_err"] = _err(e)
            traceback.print_exc()
    elif with_fi:
        row["fi_skip"] = f"FlashInfer not launched: {fi_why}"
    if B * kv <= TORCH_DECODE_MAX_TOKENS:
        try:
            with case.op("torch") as op:
                row["torch_op_us"], row["torch_op_how"] = time_us(op, graph=False, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row["torch_err"] = _err(e)
    else:
        row["torch_skip"] = f"B*kv={B * kv} > {TORCH_DECODE_MAX_TOKENS}: fp32 history gather of several GB"
    for k in ("triton_core", "fi_core"):
        t = row.get(f"{k}_us")
        if t:
            row[f"{k}_tbs"] = bytes_kv / (t * 1e-6) / 1e12
            row[f"{k}_tflops"] = flops / (t * 1e-6) / 1e12
    del case
    return row


def bench_prefill(dims_name: str, d: MLADims, T: int, prefix: int, dtype, dev, rep_ms: float) -> dict:
    row: dict = {"kind": "prefill", "dims": dims_name, "N": d.num_heads, "R": d.kv_lora_rank,
                 "Dr": d.qk_rope_head_dim, "Dn": d.qk_nope_head_dim, "Dv": d.v_head_dim, "T": T, "prefix": prefix}
    case = Case(d, [(prefix, T)], dtype, dev, seed=T + prefix)
    pairs = T * prefix + T * (T + 1) // 2
    N, r, dn, dv, dr = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.v_head_dim, d.qk_rope_head_dim
    row["flops_expand"] = 2.0 * pairs * N * (dn + dr + dv) + 2.0 * (prefix + T) * N * r * (dn + dv)
    row["flops_absorb"] = 2.0 * pairs * N * (2 * r + dr) + 2.0 * T * N * r * (dn + dv)
    row["rule"] = tuning.choose_prefill_path(d, T, prefix, pairs)
    for mode in ("auto", "expand", "absorb"):
        try:
            with case.op("triton", TritonPolicy(prefill_mode=mode)) as op:
                row[f"triton_{mode}_us"], _ = time_us(op, graph=False, rep_ms=rep_ms)
        except Exception as e:
            row[f"triton_{mode}_err"] = _err(e)
            traceback.print_exc()
    if N * T * (T + prefix) * 4 <= TORCH_PREFILL_MAX_SCORE_BYTES:
        try:
            with case.op("torch") as op:
                row["torch_op_us"], _ = time_us(op, graph=False, rep_ms=rep_ms)
        except Exception as e:
            row["torch_err"] = _err(e)
    else:
        row["torch_skip"] = "fp32 score matrix over 2 GiB"
    t = row.get("triton_auto_us")
    if t:
        fl = row["flops_" + row["rule"]]
        row["triton_auto_tflops"] = fl / (t * 1e-6) / 1e12
    e, a = row.get("triton_expand_us"), row.get("triton_absorb_us")
    if e and a:
        row["rule_picked_faster"] = (row["rule"] == "expand") == (e <= a)
    del case
    return row


# ----------------------------------------------------------------------------- tuning
# (BLOCK_H, BLOCK_N, warps, stages): all compile for sm_90 without spills (ptxas, checked offline).
DECODE_CANDIDATES_R512 = [(16, 32, 4, 2), (16, 32, 8, 2), (16, 64, 8, 3), (32, 32, 8, 2), (32, 64, 8, 3),
                          (64, 16, 8, 2), (64, 32, 8, 3)]
DECODE_CANDIDATES_R256 = [(16, 32, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2), (32, 32, 8, 3),
                          (64, 32, 8, 2), (64, 64, 8, 2)]
# (BLOCK_M, BLOCK_N, warps, stages)
EXPAND_CANDIDATES = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)]
TUNE_DECODE_SHAPES = ((8, 2048), (128, 4096))
TUNE_SPLIT_SHAPES = ((1, 8192), (8, 2048))
TUNE_PREFILL = (2048, (4096, 128))  # T of the expand sweep; (prefix, T) of the absorb sweep


@contextlib.contextmanager
def op_launch_config(name: str, cfg):
    """Make the Triton op launch its prefill kernels with `cfg`: `name` is the config function the op
    calls (expand_config / absorb_prefill_config), replaced where launchers.py looks it up. TritonPolicy has
    no launch-config knob, so the sweep swaps the function for the duration of the block."""
    orig = getattr(top, name)
    setattr(top, name, lambda *a, **k: cfg)
    try:
        yield
    finally:
        setattr(top, name, orig)


def tune(dtype, dev, rep_ms: float, dims_names) -> dict:
    out: dict = {"decode": [], "splits": [], "expand": [], "absorb_prefill": []}
    for name in dims_names:
        d = DIMS[name]
        cands = DECODE_CANDIDATES_R512 if d.kv_lora_rank > 256 else DECODE_CANDIDATES_R256
        cands = [c for c in cands if c[0] <= max(16, 1 << (d.num_heads - 1).bit_length())]
        for B, kv in TUNE_DECODE_SHAPES:
            case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=1)
            for bh, bn, w, st in cands:
                cfg = tuning.AbsorbedConfig(bh, 1, bn, w, st)
                try:
                    run, *_ = decode_core_triton(case, cfg)
                    t, _ = time_us(run, graph=True, rep_ms=rep_ms)
                except Exception as e:
                    t = None
                    print("tune decode", name, cfg, _err(e))
                out["decode"].append({"dims": name, "batch": B, "kv_len": kv, "cfg": [bh, bn, w, st], "us": t})
                print(f"tune decode {name:22s} B={B:3d} kv={kv:5d} cfg={cfg} -> {t}", flush=True)
            del case
        if name in ("deepseek_v3_tp8_n16", "mistral_small_4_n32", "smoke_n5"):
            for B, kv in TUNE_SPLIT_SHAPES:
                case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=2)
                for s in (1, 2, 4, 8, 16, 32, 64):
                    try:
                        run, *_ = decode_core_triton(case, None, s)
                        t, _ = time_us(run, graph=True, rep_ms=rep_ms)
                    except Exception as e:
                        t = None
                        print("tune splits", _err(e))
                    auto = decode_core_triton(case)[3]
                    out["splits"].append({"dims": name, "batch": B, "kv_len": kv, "splits": s, "us": t, "auto": auto})
                    print(f"tune splits {name:22s} B={B:3d} kv={kv:5d} splits={s:3d} (auto {auto}) -> {t}", flush=True)
                del case
        case = Case(d, [(0, TUNE_PREFILL[0])], dtype, dev, seed=3)
        for bm, bn, w, st in EXPAND_CANDIDATES:
            try:
                with (op_launch_config("expand_config", tuning.ExpandConfig(bm, bn, w, st)),
                      case.op("triton", TritonPolicy(prefill_mode="expand")) as op):
                    t, _ = time_us(op, graph=False, rep_ms=rep_ms)
            except Exception as e:
                t = None
                print("tune expand", _err(e))
            out["expand"].append({"dims": name, "T": TUNE_PREFILL[0], "cfg": [bm, bn, w, st], "us": t})
            print(f"tune expand {name:22s} cfg={(bm, bn, w, st)} -> {t}", flush=True)
        del case
        case = Case(d, [TUNE_PREFILL[1]], dtype, dev, seed=4)
        bh = min(64, max(16, 1 << (d.num_heads - 1).bit_length()))
        for rows, bn in ((32, 32), (64, 16), (64, 32)):
            if rows < bh:
                continue
            cfg = tuning.AbsorbedConfig(bh, rows // bh, bn, 8, 2)
            try:
                with (op_launch_config("absorb_prefill_config", cfg),
                      case.op("triton", TritonPolicy(prefill_mode="absorb")) as op):
                    t, _ = time_us(op, graph=False, rep_ms=rep_ms)
            except Exception as e:
                t = None
                print("tune absorb", _err(e))
            out["absorb_prefill"].append({"dims": name, "prefix_T": list(TUNE_PREFILL[1]), "cfg": [bh, rows // bh, bn],
                                          "us": t})
            print(f"tune absorb-prefill {name:22s} cfg={cfg} -> {t}", flush=True)
        del case
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


# ----------------------------------------------------------------------------- report
def _f(x, nd=1):
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_report(res: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mla_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    L = [
        "# MLA kernel benchmark (Triton backend vs FlashInfer vs torch reference)",
        "",
        f"Machine: {m['gpu']}, torch {m['torch']}, triton {m['triton']}, flashinfer {m['flashinfer']}, "
        f"{m['date']}. Command: `{m['command']}`.",
        "",
        f"bf16, page size {PAGE}, random data over shuffled pages. Times are medians (µs) of "
        + ("`triton.testing.do_bench` (L2 flushed before each run by zeroing 256 MB: dirty lines the timed "
           "kernel's first reads write back) " if res.get("flush", "zero") == "zero" else
           "a `do_bench`-like loop whose L2 flush reads 256 MB (`--flush read`: cold, clean L2) ")
        + "over a CUDA-graph replay of the region, "
        "except *eager* columns and prefill (one eager call, as prefill runs between graph pieces). "
        f"Ceilings: {COPY_TBS} TB/s copy, {BF16_TFLOPS:.0f} TFLOP/s bf16 (measured, DESIGN §12). "
        "Bytes = cached latent+rope read once (B·kv·(R+Dr)·2); FLOPs = 2·B·N·kv·(2R+Dr).",
        "",
        "## Decode",
        "",
        "core = attention kernels only (q_abs given, latent out); op = whole cached op "
        "(append + q_abs GEMM + attention + W_v GEMM). FlashInfer: `BatchMLAPagedAttentionWrapper` "
        "run() (plan excluded, shown as plan ms); its op column wraps run() in the same GEMMs/append.",
        "",
        "heads on M / heads on N = the decode core on each kernel (absorbed_attn_kernel / "
        "absorbed_attn_heads_on_n_kernel, `tl` kernels); *layout* = what the op runs (its time is the core "
        "column): `decode_config`'s pick, or *gluon* = the warp-specialised Gluon kernels "
        "(`triton_mla/gluon_decode.py`, heads on N, N <= 32; `gluon_decode_wide.py`, 64 heads per program on M, "
        "N > 32), which `TritonPolicy.decode_kernel=\"auto\"` runs on SM90 for R 256/512 (N > 32: R 512), Dr 64.",
        "",
        "| dims | B | kv | layout | splits | triton core µs | TB/s | %4.3 | TFLOP/s | heads on M µs | heads on N µs "
        "| FI core µs | triton/FI | FI plan ms | triton op µs | triton op eager µs | FI op µs | torch op µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"]:
        tc, fc = r.get("triton_core_us"), r.get("fi_core_us")
        ratio = tc / fc if tc and fc else None
        tbs = r.get("triton_core_tbs")
        L.append(
            f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {r.get('triton_layout', 'heads_on_m')} | "
            f"{_f(r.get('triton_splits'))} | {_f(tc)} | {_f(tbs, 2)} | "
            f"{_f(tbs / COPY_TBS * 100 if tbs else None, 0)} | {_f(r.get('triton_core_tflops'), 0)} | "
            f"{_f(r.get('triton_m_core_us'))} | {_f(r.get('triton_n_core_us'))} | "
            f"{_f(fc) if fc else ('n/a' if 'fi_skip' in r else ('err' if 'fi_err' in r else '—'))} | {_f(ratio, 2)} | "
            f"{_f(r.get('fi_plan_ms'), 2)} | {_f(r.get('triton_op_us'))} | {_f(r.get('triton_op_eager_us'))} | "
            f"{_f(r.get('fi_op_us'))} | {_f(r.get('torch_op_us')) if 'torch_skip' not in r else 'skipped'} |"
        )
    skips = sorted({f"{r['dims']}: {r['fi_skip']}" for r in res["decode"] if r.get("fi_skip")})
    L += ["", "n/a: FlashInfer not launched where the installed version's capability facts refuse the dims"
          + (" (" + "; ".join(skips) + ")" if skips else "") + ". skipped: torch reference over B·kv > 262144 "
          "tokens (several GB of fp32 gathers).", ""]
    L += ["## Prefill (one sequence, T new tokens on a cached prefix)", "",
          "| dims | T | prefix | rule | triton auto µs | expand µs | absorb µs | rule picked faster | TFLOP/s (auto) "
          "| torch op µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["prefill"]:
        L.append(
            f"| {r['dims']} | {r['T']} | {r['prefix']} | {r['rule']} | {_f(r.get('triton_auto_us'))} | "
            f"{_f(r.get('triton_expand_us'))} | {_f(r.get('triton_absorb_us'))} | {_f(r.get('rule_picked_faster'))} | "
            f"{_f(r.get('triton_auto_tflops'), 0)} | "
            f"{_f(r.get('torch_op_us')) if 'torch_skip' not in r else 'skipped'} |"
        )
    if res.get("prefill_note"):
        L += ["", res["prefill_note"]]
    if res.get("tune"):
        L += tune_section(res)
    errs = [(r["dims"], k, v) for r in res["decode"] + res["prefill"] for k, v in r.items() if k.endswith("_err")]
    if errs:
        L += ["", "## Errors", ""] + [f"- {a} {k}: {v}" for a, k, v in errs]
    if res.get("targets"):
        L += ["", "## Targets", ""] + [f"- {t}" for t in res["targets"]]
    with open(os.path.join(out_dir, "mla_kernels.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    try:
        plot(res, os.path.join(out_dir, "mla_kernels.png"))
    except Exception as e:
        print("plot failed:", _err(e))


def tune_section(res: dict) -> list[str]:
    """The launch-config / split sweep (`--tune`): per dim set, every candidate's decode-core time."""
    t = res["tune"]
    L = ["", "## Launch-config and split-K sweep (`--tune`)", ""]
    if res.get("tune_note"):
        L += [res["tune_note"], ""]
    L += ["Decode core µs (CUDA graph, median) per (BLOCK_H, BLOCK_N, warps, stages); **bold** = the op's "
          "current default (`decode_config`).", ""]
    shapes = sorted({(r["batch"], r["kv_len"]) for r in t["decode"]})
    L += ["| dims | config | " + " | ".join(f"B={b} kv={k} µs (TB/s)" for b, k in shapes) + " |",
          "|---|---|" + "---|" * len(shapes)]
    for name in dict.fromkeys(r["dims"] for r in t["decode"]):
        d = DIMS.get(name)
        cur = tuning.decode_config(d, torch.bfloat16) if d else None
        cfgs = list(dict.fromkeys(tuple(r["cfg"]) for r in t["decode"] if r["dims"] == name))
        for c in cfgs:
            cells = []
            for b, k in shapes:
                r = next((r for r in t["decode"] if r["dims"] == name and tuple(r["cfg"]) == c
                          and (r["batch"], r["kv_len"]) == (b, k)), None)
                us = r and r["us"]
                tbs = us and b * k * (d.kv_lora_rank + d.qk_rope_head_dim) * 2 / (us * 1e-6) / 1e12 if d else None
                cells.append(f"{_f(us)} ({_f(tbs, 2)})" if us else "—")
            is_cur = cur is not None and (cur.block_h, cur.block_n, cur.num_warps, cur.num_stages) == c
            lab = f"**{c}**" if is_cur else str(c)
            L.append(f"| {name} | {lab} | " + " | ".join(cells) + " |")
    if t.get("splits"):
        L += ["", "Split-K count (decode core µs; forced splits, chunk = kv/splits rounded to BLOCK_N):", "",
              "| dims | B | kv | " + " | ".join(str(s) for s in sorted({r["splits"] for r in t["splits"]})) + " |",
              "|---|---|---|" + "---|" * len({r["splits"] for r in t["splits"]})]
        for key in dict.fromkeys((r["dims"], r["batch"], r["kv_len"]) for r in t["splits"]):
            rows = sorted((r for r in t["splits"] if (r["dims"], r["batch"], r["kv_len"]) == key),
                          key=lambda r: r["splits"])
            L.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(_f(r["us"]) for r in rows) + " |")
    if t.get("expand"):
        L += ["", "Expanded prefill kernel, T=2048 fresh prefill, whole op µs per (BLOCK_M, BLOCK_N, warps, "
              "stages):", "", "| dims | " + " | ".join(str(tuple(r["cfg"])) for r in t["expand"][:4]) + " |",
              "|---|" + "---|" * 4]
        for name in dict.fromkeys(r["dims"] for r in t["expand"]):
            L.append(f"| {name} | " + " | ".join(_f(r["us"]) for r in t["expand"] if r["dims"] == name) + " |")
    if t.get("absorb_prefill"):
        L += ["", "Absorbed prefill (T=128 on a 4096 prefix), whole op µs per (BLOCK_H, BLOCK_Q, BLOCK_N):", ""]
        for name in dict.fromkeys(r["dims"] for r in t["absorb_prefill"]):
            L.append(f"- {name}: " + ", ".join(f"{tuple(r['cfg'])}: {_f(r['us'])}" for r in t["absorb_prefill"]
                                                if r["dims"] == name))
    return L


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dims"] for r in res["decode"]))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    ax = axes[0]
    for i, name in enumerate(names):
        rows = sorted((r for r in res["decode"] if r["dims"] == name and r.get("triton_core_tbs")),
                      key=lambda r: (r["batch"] * r["kv_len"], r["batch"]))
        xs = [r["batch"] * r["kv_len"] for r in rows]
        ax.plot(xs, [r["triton_core_tbs"] for r in rows], "o-", color=f"C{i}", label=f"triton {name}")
        fr = [r for r in rows if r.get("fi_core_tbs")]
        if fr:
            ax.plot([r["batch"] * r["kv_len"] for r in fr], [r["fi_core_tbs"] for r in fr], "x--", color=f"C{i}",
                    label=f"FlashInfer {name}")
    ax.axhline(COPY_TBS, color="k", lw=0.8, ls=":", label="4.3 TB/s copy")
    ax.axhline(0.75 * COPY_TBS, color="gray", lw=0.8, ls=":", label="75%")
    ax.set_xscale("log")
    ax.set_xlabel("batch × kv_len (cached tokens read)")
    ax.set_ylabel("achieved TB/s (decode core)")
    ax.set_title("Decode attention core: bandwidth")
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, name in enumerate(names):
        rows = sorted((r for r in res["decode"] if r["dims"] == name and r.get("triton_op_us")),
                      key=lambda r: (r["batch"] * r["kv_len"], r["batch"]))
        ax.plot([r["batch"] * r["kv_len"] for r in rows], [r["triton_op_us"] for r in rows], "o-", color=f"C{i}",
                label=f"triton op {name}")
        tr = [r for r in rows if r.get("torch_op_us")]
        ax.plot([r["batch"] * r["kv_len"] for r in tr], [r["torch_op_us"] for r in tr], "s:", color=f"C{i}", alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch × kv_len")
    ax.set_ylabel("µs (full decode op; dotted squares: torch reference)")
    ax.set_title("Full cached decode op (CUDA graph)")
    ax.legend(fontsize=7)
    ax = axes[2]
    pre = res["prefill"]
    labels = [f"{r['dims'].split('_n')[0][:10]}\nT{r['T']} P{r['prefix']}" for r in pre]
    xs = range(len(pre))
    ax.bar([x - 0.2 for x in xs], [r.get("triton_expand_us") or 0 for r in pre], 0.4, label="expand")
    ax.bar([x + 0.2 for x in xs], [r.get("triton_absorb_us") or 0 for r in pre], 0.4, label="absorb")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("µs")
    ax.set_title("Prefill: expansion vs absorption (forced)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(res: dict) -> list[str]:
    """Issue 14's decode targets, from this run's rows (FlashInfer from the same run)."""
    out = []
    dec = [r for r in res["decode"] if r.get("triton_core_us")]
    n128 = [r for r in dec if r["N"] == 128 and r.get("fi_core_us")]
    for lo, hi, lim in ((32, 1 << 30, 1.0), (1, 8, 1.2)):
        rows = [r for r in n128 if lo <= r["batch"] <= hi]
        if rows:
            met = sum(r["triton_core_us"] <= lim * r["fi_core_us"] for r in rows)
            worst = max(rows, key=lambda r: r["triton_core_us"] / r["fi_core_us"])
            out.append(f"N=128, batch {lo}-{hi if hi < 1 << 30 else 'up'}: core <= {lim}x FlashInfer in {met}/{len(rows)}; "
                       f"worst B={worst['batch']} kv={worst['kv_len']}: {worst['triton_core_us'] / worst['fi_core_us']:.2f}x")
    big = next((r for r in n128 if r["batch"] == 128 and r["kv_len"] == 8192), None)
    if big:
        out.append(f"N=128 B=128 kv=8192: {big['triton_core_tflops']:.0f} TFLOP/s (target >= 450)")
    mb = [r for r in dec if r["N"] <= 32 and r["batch"] * r["kv_len"] >= 64 * 4096 and r.get("triton_core_tbs")]
    if mb:
        met = sum(r["triton_core_tbs"] >= 0.85 * COPY_TBS for r in mb)
        lo = min(mb, key=lambda r: r["triton_core_tbs"])
        out.append(f">= 85% of {COPY_TBS} TB/s where memory-bound (N<=32, B*kv>=64*4096): {met}/{len(mb)}; lowest "
                   f"{lo['dims']} B={lo['batch']} kv={lo['kv_len']}: {lo['triton_core_tbs']:.2f} TB/s")
        fi = [r for r in mb if r.get("fi_core_us")]
        if fi:
            met = sum(r["triton_core_us"] <= r["fi_core_us"] for r in fi)
            worst = max(fi, key=lambda r: r["triton_core_us"] / r["fi_core_us"])
            out.append(f"memory-bound rows <= 1.0x FlashInfer: {met}/{len(fi)}; worst {worst['dims']} B={worst['batch']} "
                       f"kv={worst['kv_len']}: {worst['triton_core_us'] / worst['fi_core_us']:.2f}x")
    return out


def machine(cmd: str) -> dict:
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": v("triton"), "flashinfer": v("flashinfer-python"),
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": cmd}


def main(argv=None) -> int:
    global DIMS, PAGE, TUNE_DECODE_SHAPES, TUNE_SPLIT_SHAPES, TUNE_PREFILL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--dims", nargs="*", default=list(DIMS))
    ap.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    ap.add_argument("--kv", nargs="*", type=int, default=list(KV_LENS))
    ap.add_argument("--prefill-t", nargs="*", type=int, default=list(PREFILL_T))
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--tune", action="store_true", help="sweep launch configs / split policy instead")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (CPU: Triton interpreter)")
    ap.add_argument("--report-from", metavar="JSON", help="rewrite md/png from a results JSON (no GPU needed)")
    ap.add_argument("--tune-json", metavar="JSON", help="with --report-from: add this --tune output")
    ap.add_argument("--note", default="", help="with --report-from: a note for the sweep section")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="zero",
                    help="how L2 is emptied before each timed decode run (FLUSH_MODES; prefill: always zero)")
    a = ap.parse_args(argv)
    if a.report_from:
        with open(a.report_from) as f:
            res = json.load(f)
        if a.tune_json:
            with open(a.tune_json) as f:
                tj = json.load(f)
            res["tune"], res["tune_machine"] = tj["tune"], tj["machine"]
        if a.note:
            res["tune_note"] = a.note
        res["targets"] = targets(res)
        write_report(res, a.out)
        print("\n".join(res["targets"]))
        return 0
    cmd = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    if a.smoke:
        TUNE_DECODE_SHAPES, TUNE_SPLIT_SHAPES, TUNE_PREFILL = ((2, 40),), ((1, 40),), (24, (16, 8))
        DIMS = {"smoke_n5": MLADims(5, 16, 8, 24, 32), "smoke_n20_r64": MLADims(20, 16, 16, 16, 64)}
        a.dims, a.batches, a.kv, a.prefill_t, a.rep_ms = list(DIMS), [1, 3], [40], [24], 5
        PAGE = 16
        if dev == "cpu":
            dtype = torch.float32
    if a.tune:
        t0 = time.time()
        res = {"machine": machine(cmd), "tune": tune(dtype, dev, min(a.rep_ms, 20), a.dims)}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "mla_tune.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"tuning done in {time.time() - t0:.0f}s")
        return 0
    with_fi = not a.no_flashinfer and dev == "cuda"
    if with_fi:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            print("FlashInfer unavailable:", _err(e))
            with_fi = False
    res: dict = {"machine": machine(cmd), "decode": [], "prefill": [], "flush": a.flush}
    t0 = time.time()
    for name in a.dims:
        d = DIMS[name]
        for B in a.batches:
            for kv in a.kv:
                r = bench_decode(name, d, B, kv, dtype, dev, a.rep_ms, with_fi, a.flush)
                res["decode"].append(r)
                print(f"[{time.time() - t0:5.0f}s] decode {name:22s} B={B:3d} kv={kv:5d} "
                      f"triton core {_f(r.get('triton_core_us'))} µs ({_f(r.get('triton_core_tbs'), 2)} TB/s, "
                      f"splits {r.get('triton_splits')}) FI {_f(r.get('fi_core_us'))} | op graph "
                      f"{_f(r.get('triton_op_us'))} eager {_f(r.get('triton_op_eager_us'))} FI op {_f(r.get('fi_op_us'))} "
                      f"torch {_f(r.get('torch_op_us'))}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not a.no_prefill:
        for name in a.dims:
            for T in a.prefill_t:
                for prefix in (PREFILL_PREFIX if not a.smoke else (0, 16)):
                    r = bench_prefill(name, DIMS[name], T, prefix, dtype, dev, a.rep_ms)
                    res["prefill"].append(r)
                    print(f"[{time.time() - t0:5.0f}s] prefill {name:22s} T={T:5d} P={prefix:5d} rule={r['rule']:6s} "
                          f"auto {_f(r.get('triton_auto_us'))} expand {_f(r.get('triton_expand_us'))} absorb "
                          f"{_f(r.get('triton_absorb_us'))} torch {_f(r.get('torch_op_us'))}", flush=True)
    res["targets"] = targets(res)
    res["seconds"] = time.time() - t0
    write_report(res, a.out)
    print("\n".join(res["targets"]))
    print(f"done in {res['seconds']:.0f}s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
