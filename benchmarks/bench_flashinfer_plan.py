"""FlashInfer MLA: what plan() costs, what run() costs, and why plan runs once per step.

Measures on the current GPU (bf16, page 64 unless stated):
  1. plan cost (host): our whole per-step prepare (CSR from host metadata + one plan), the CSR build
     alone, and FlashInfer's plan() alone, for decode and mixed batches;
  2. run cost (device, CUDA events, median of triton.testing.do_bench): FlashInfer run() alone, the
     whole flashinfer_mla_with_cache op (append + q·W_kn + run + ·W_v) with strided and with contiguous
     query/latent tensors, and the torch reference op; every op's output is checked against the
     torch reference op on the same inputs first;
  3. per-step cost of a 61-layer model (DeepSeek-V3 depth), wall clock with a synchronize at the end:
     one plan + 61 runs (this backend) vs 61 plans + 61 runs (planning per layer) vs 61 runs alone;
  4. pure prefill: flashinfer_mla vs the Triton op (if registered and accepting) vs torch reference.

Writes flashinfer_plan.json, flashinfer_plan.md and flashinfer_plan.png into --out.

    python benchmarks/bench_flashinfer_plan.py --out docs/benchmarks
    python benchmarks/bench_flashinfer_plan.py --device cpu --fake --quick --out /tmp/x   # dry run, no GPU

Every backend runs as in a model: a session from `setup(SessionSpec, policy)` sized to the step,
prepared once per step (`session.prepare`), and published to the op with `using_sessions`. Steps with
prefill tokens are timed on FlashInfer itself (`FlashInferPolicy(prefill="flashinfer")`), not routed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from autodeploy_mla.custom_ops import BackendSession, MLADims, SessionSpec, Target, all_backends, get_backend
from autodeploy_mla.custom_ops.flashinfer.metadata import mla_csr
from autodeploy_mla.custom_ops.flashinfer.mla import FlashInferPolicy
from autodeploy_mla.custom_ops.attention.step_context import using_sessions
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence
from autodeploy_mla.runtime.model_runner import step_descriptor

BF16 = torch.bfloat16
DS = lambda n: MLADims(n, 128, 64, 128, 512)  # noqa: E731  DeepSeek-V3 per-head dims
#: plan/run/layers/route time FlashInfer itself: every step stays on it (no prefill routing to Triton).
FI_ONLY = FlashInferPolicy(prefill="flashinfer")


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _host_median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _device_median_us(fn, dev, quick: bool) -> float:
    if dev.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100 if not quick else 20, return_mode="median") * 1e3
    return _host_median_ms(fn, 3) * 1e3


class Step:
    """One step's metadata + inputs for `dims` with `seqs` = [(new_tokens, cached_tokens)]."""

    def __init__(self, dims, seqs, dev, page_size=64, layers=1, seed=0):
        self.dims, self.dev = dims, dev
        max_len = max(n + c for n, c in seqs)
        t = sum(n for n, _ in seqs)
        self.info = SequenceInfo(len(seqs), t, max_len, page_size, dev)
        self.alloc = PageAllocator(1 + len(seqs) * self.info.max_pages_per_seq, page_size, self.info.max_pages_per_seq)
        self.alloc.ensure_many({i: n + c for i, (n, c) in enumerate(seqs)})
        self.info.prepare_step([StepSequence(i, [0] * n, c) for i, (n, c) in enumerate(seqs)], self.alloc.pages_of)
        g = torch.Generator(dev).manual_seed(seed)
        d = dims

        def r(*shape, s=1.0):
            return (torch.randn(*shape, generator=g, device=dev) * s).to(BF16)

        self.x = [r(1, t, d.num_heads, d.qk_nope_head_dim), r(1, t, d.num_heads, d.qk_rope_head_dim),
                  r(1, t, d.kv_lora_rank), r(1, t, 1, d.qk_rope_head_dim)]
        self.layers = []
        for _ in range(layers):
            w = r(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, s=d.kv_lora_rank ** -0.5)
            cache = r(self.alloc.num_pages, page_size, d.latent_dim)
            self.layers.append((w, cache))
        self.num_tokens = t
        # size of the torch reference op's score grid (seqs x heads x max new x max kv): skip it when huge
        self.ref_elems = len(seqs) * d.num_heads * max(n for n, _ in seqs) * max_len

    def args(self, be, layer=0):
        w, cache = self.layers[layer]
        return (*self.x, w, *[self.info.get(m) for m in be.metadata], cache, None)

    def target(self) -> Target:
        return Target.detect(self.dev, self.info.page_size)

    def session(self, name: str, policy=None) -> BackendSession:
        """A session of backend `name` serving this step's dims, sized to the step and prepared for it."""
        info = self.info
        spec = SessionSpec((self.dims,), BF16, self.dev, self.target(), info.max_batch_size, info.max_num_tokens,
                           info.max_pages_per_seq)
        sess = get_backend(name).setup(spec, policy)
        sess.prepare(info, step_descriptor(info))
        return sess


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench_plan(dev, quick):
    cases = [("decode", 128, [(1, 511)] * 32), ("decode", 128, [(1, 8191)]), ("decode", 128, [(1, 4095)] * 128),
             ("decode", 16, [(1, 4095)] * 64), ("mixed", 128, [(512, 0), (512, 1024)] + [(1, 2047)] * 62)]
    if quick:
        cases = cases[:2]
    rows = []
    for kind, n, seqs in cases:
        s = Step(DS(n), seqs, dev)
        sess = s.session("flashinfer_mla", FI_ONLY)
        key = next(iter(sess.configs))
        w = sess.eager[key]
        info = s.info
        desc = step_descriptor(info)
        csr = mla_csr(info.get("cu_seqlen_host"), info.get("seq_len_with_cache_host"), info.get("page_table_host"),
                      len(seqs), info.page_size)
        reps = 10 if quick else 200

        def raw_plan():
            w.plan(qo_indptr=csr.qo_indptr, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices, kv_len_arr=csr.kv_len,
                   num_heads=n, head_dim_ckv=512, head_dim_kpe=64, page_size=info.page_size, causal=True,
                   sm_scale=1.0, q_data_type=BF16, kv_data_type=BF16)

        row = {
            "kind": kind, "N": n, "batch": len(seqs), "tokens": s.num_tokens,
            "max_kv": max(a + b for a, b in seqs),
            "prepare_ms": _host_median_ms(lambda: sess.prepare(info, desc), reps),
            "csr_ms": _host_median_ms(lambda: mla_csr(info.get("cu_seqlen_host"), info.get("seq_len_with_cache_host"),
                                                      info.get("page_table_host"), len(seqs), info.page_size), reps),
            "fi_plan_ms": _host_median_ms(raw_plan, reps),
        }
        _sync(dev)
        rows.append(row)
        print(f"plan  {kind:6s} N={n:3d} batch={len(seqs):3d} tokens={s.num_tokens:5d}: prepare {row['prepare_ms']:.3f} ms "
              f"(csr {row['csr_ms']:.3f}, FlashInfer plan {row['fi_plan_ms']:.3f})", flush=True)
    return rows


def bench_run(dev, quick):
    be, ref_be = get_backend("flashinfer_mla"), get_backend("torch")
    cases = [(128, [(1, 511)] * 32), (128, [(1, 8191)]), (128, [(1, 4095)] * 128), (16, [(1, 4095)] * 64),
             (128, [(128, 0), (128, 256)] + [(1, 1023)] * 30), (128, [(512, 0), (512, 1024)] + [(1, 2047)] * 62)]
    if quick:
        cases = cases[:2]
    rows = []
    for n, seqs in cases:
        s = Step(DS(n), seqs, dev)
        # strided / contiguous query and latent tensors: one session per FlashInferPolicy.strided_io
        sessions = {strided: s.session("flashinfer_mla", replace(FI_ONLY, strided_io=strided))
                    for strided in (True, False)}
        key = next(iter(sessions[True].configs))
        w, cache = s.layers[0]
        ref_cache = cache.clone()
        small = s.ref_elems < 1e9
        out_ref = ref_be.cached_op(*s.x, w, *[s.info.get(m) for m in ref_be.metadata], ref_cache, None) if small else None
        res = {}
        for strided, sess in sessions.items():
            c2 = cache.clone()
            with using_sessions({"flashinfer_mla": sess}):
                out = be.cached_op(*s.x, w, *[s.info.get(m) for m in be.metadata], c2, None)
                res[strided] = rel_err(out[0, : s.num_tokens], out_ref[0, : s.num_tokens]) if small else float("nan")
                lab = "op_strided_us" if strided else "op_contiguous_us"
                res[lab] = _device_median_us(
                    lambda: be.cached_op(*s.x, w, *[s.info.get(m) for m in be.metadata], c2, None), dev, quick)
        wr = sessions[True].step.wrappers.get(key)
        t = s.num_tokens
        q_abs = torch.randn(t, n, 512, device=dev).to(BF16)
        q_pe = torch.randn(t, n, 64, device=dev).to(BF16)
        lat = torch.empty_like(q_abs)
        fi_run = (_device_median_us(lambda: wr.run(q_abs, q_pe, cache[..., :512], cache[..., 512:], out=lat), dev, quick)
                  if wr is not None else float("nan"))
        ref_us = _device_median_us(lambda: ref_be.cached_op(*s.x, w, *[s.info.get(m) for m in ref_be.metadata],
                                                            ref_cache, None), dev, quick) if small else float("nan")
        kv_tokens = sum(a + b for a, b in seqs)
        row = {"N": n, "batch": len(seqs), "tokens": t, "kv_tokens": kv_tokens, "fi_run_us": fi_run,
               "op_strided_us": res["op_strided_us"], "op_contiguous_us": res["op_contiguous_us"], "torch_ref_us": ref_us,
               "rel_err_strided": res[True], "rel_err_contiguous": res[False],
               "fi_run_TBps": kv_tokens * 576 * 2 / (fi_run * 1e-6) / 1e12 if fi_run == fi_run else float("nan")}
        rows.append(row)
        print(f"run   N={n:3d} batch={len(seqs):3d} kv={kv_tokens:7d}: FlashInfer run {fi_run:8.1f} us "
              f"({row['fi_run_TBps']:.2f} TB/s) | op strided {row['op_strided_us']:8.1f} us, contiguous "
              f"{row['op_contiguous_us']:8.1f} us | torch ref {ref_us:9.1f} us | rel err {res[True]:.2e}/{res[False]:.2e}",
              flush=True)
    return rows


def bench_61_layers(dev, quick):
    layers = 4 if quick else 61
    cases = [(128, [(1, 2047)] * 64), (128, [(1, 511)] * 8), (16, [(1, 4095)] * 32)]
    if quick:
        cases = cases[:1]
    rows = []
    for n, seqs in cases:
        row = _layers_case(dev, n, seqs, layers, reps=3 if quick else 40)
        rows.append(row)
        print(f"step  {layers} layers N={n:3d} batch={len(seqs):3d}: one plan + runs {row['one_plan_ms']:.2f} ms | "
              f"plan per layer {row['per_layer_plans_ms']:.2f} ms | runs only {row['runs_only_ms']:.2f} ms", flush=True)
    return rows


def _layers_case(dev, n, seqs, layers, reps):
    """One decode step of `layers` layers, wall clock: one plan + runs vs a plan per layer vs runs alone."""
    be = get_backend("flashinfer_mla")
    s = Step(DS(n), seqs, dev, layers=layers)
    sess = s.session("flashinfer_mla", FI_ONLY)
    key = next(iter(sess.configs))
    info = s.info
    desc = step_descriptor(info)
    csr = mla_csr(info.get("cu_seqlen_host"), info.get("seq_len_with_cache_host"), info.get("page_table_host"),
                  len(seqs), info.page_size)
    layer_args = [s.args(be, i) for i in range(layers)]

    def one_plan():
        sess.prepare(info, desc)
        for a in layer_args:
            be.cached_op(*a)
        _sync(dev)

    def per_layer_plans():  # the naive alternative: plan before every layer's run
        sess.prepare(info, desc)
        w = sess.step.wrappers[key]
        for a in layer_args:
            w.plan(qo_indptr=csr.qo_indptr, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices,
                   kv_len_arr=csr.kv_len, num_heads=n, head_dim_ckv=512, head_dim_kpe=64,
                   page_size=info.page_size, causal=True, sm_scale=1.0, q_data_type=BF16, kv_data_type=BF16)
            be.cached_op(*a)
        _sync(dev)

    def runs_only():
        for a in layer_args:
            be.cached_op(*a)
        _sync(dev)

    variants = {"one_plan_ms": one_plan, "per_layer_plans_ms": per_layer_plans, "runs_only_ms": runs_only}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with using_sessions({"flashinfer_mla": sess}):
        for f in variants.values():
            f()  # warm-up
        for i in range(reps):  # interleaved, rotating order: host/GPU drift hits every variant alike
            names = list(variants)
            names = names[i % 3:] + names[: i % 3]
            for k in names:
                t0 = time.perf_counter()
                variants[k]()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {"N": n, "batch": len(seqs), "kv_len": seqs[0][0] + seqs[0][1], "layers": layers,
            **{k: statistics.median(v) for k, v in times.items()},
            **{k.replace("_ms", "_p10_p90_ms"): (sorted(v)[len(v) // 10], sorted(v)[(9 * len(v)) // 10])
               for k, v in times.items()}}


ROUTE_CASES = [
    ("prefill 1x128", 128, [(128, 0)]), ("prefill 1x512", 128, [(512, 0)]), ("prefill 1x2048", 128, [(2048, 0)]),
    ("prefill 8x512", 128, [(512, 0)] * 8), ("prefill 2x2048", 16, [(2048, 0)] * 2),
    ("chunked 4x512 on 3584 cached", 128, [(512, 3584)] * 4),
    ("mixed 1x128 + 32 decode@1024", 128, [(128, 0)] + [(1, 1023)] * 32),
    ("mixed 2x512 + 62 decode@2048", 128, [(512, 0), (512, 1024)] + [(1, 2047)] * 62),
    ("decode 64@2048", 128, [(1, 2047)] * 64),
]


def bench_route(dev, quick):
    """Steps with prefill tokens: FlashInfer's absorbed path vs the Triton op vs the torch reference (eager)."""
    rows = []
    cases = ROUTE_CASES if not quick else [("prefill 1x64", 16, [(64, 0)]), ("mixed", 16, [(16, 0), (1, 40)])]
    names = [b for b in ("torch", "flashinfer_mla", "triton") if b in all_backends()]
    for label, n, seqs in cases:
        s = Step(DS(n), seqs, dev)
        row = {"case": label, "N": n, "seqs": len(seqs), "tokens": s.num_tokens}
        ref, ref_name = None, None
        for name in names:
            if name == "torch" and s.ref_elems >= 1e9:
                row["torch_us"] = None
                row["torch_why"] = "reference score grid too large"
                continue
            be = get_backend(name)
            chk = be.check(s.dims, BF16, s.target())
            if not chk.ok:
                row[f"{name}_us"], row[f"{name}_why"] = None, chk.reason
                continue
            w, cache = s.layers[0]
            c2 = cache.clone()
            try:
                # FlashInfer: time FlashInfer itself, not the routing; the others: their default policy
                sess = s.session(name, FI_ONLY if name == "flashinfer_mla" else None)
                with using_sessions({name: sess}):
                    out = be.cached_op(*s.x, w, *[s.info.get(m) for m in be.metadata], c2, None)
                    if ref is None:
                        ref, ref_name = out, name
                    row[f"{name}_rel_err"] = rel_err(out, ref)
                    row[f"{name}_us"] = _device_median_us(
                        lambda: be.cached_op(*s.x, w, *[s.info.get(m) for m in be.metadata], c2, None), dev, quick)
            except Exception as e:  # another engineer's backend may not handle this case yet: record, go on
                row[f"{name}_us"], row[f"{name}_why"] = None, f"{type(e).__name__}: {e}"[:200]
        row["err_vs"] = ref_name
        rows.append(row)
        print("route " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return rows


def _capture(fn, dev):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def bench_graph(dev, quick):
    """Decode device time without host overhead: the op captured in a CUDA graph, replays timed."""
    if dev.type != "cuda":
        return []
    rows = []
    # FlashInfer: fixed-buffer (CUDA-graph) wrappers for every decode step of the session
    policies = {"flashinfer_mla": FlashInferPolicy(cuda_graph=True), "triton": None}
    # the 61-layer rows: DeepSeek-V3's depth, a whole decode step's attention ops at batch 1 / 8 / 64 / 128
    cases = [(128, [(1, 511)] * 32, 1), (128, [(1, 4095)] * 128, 1), (16, [(1, 4095)] * 64, 1),
             (128, [(1, 1023)], 61), (128, [(1, 2047)] * 8, 61), (128, [(1, 2047)] * 64, 61),
             (128, [(1, 4095)] * 128, 61)]
    if quick:
        cases = cases[:1]
    for n, seqs, layers in cases:
        row = {"N": n, "batch": len(seqs), "kv_len": seqs[0][0] + seqs[0][1], "layers": layers}
        s = Step(DS(n), seqs, dev, layers=layers)
        for name, policy in policies.items():
            if name not in all_backends():
                continue
            be = get_backend(name)
            if not be.decode_graph_safe or not be.check(s.dims, BF16, s.target()).ok:
                continue
            try:
                sess = s.session(name, policy)
                layer_args = [s.args(be, i) for i in range(layers)]

                def step():
                    for a in layer_args:
                        be.cached_op(*a)

                with using_sessions({name: sess}):
                    g = _capture(step, dev)
                    row[f"{name}_graph_us"] = _device_median_us(g.replay, dev, quick)
                    row[f"{name}_eager_us"] = _device_median_us(step, dev, quick)
                del g
            except Exception as e:
                row[f"{name}_why"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print("graph " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        del s
    return rows


def write_outputs(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    def clean(x):  # NaN (not measured) -> null: strict JSON
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    (out_dir / "flashinfer_plan.json").write_text(json.dumps(clean(result), indent=1))
    m = result["machine"]
    lines = ["# FlashInfer MLA: plan cost, run cost, per-step cost", "",
             f"Machine: {m['gpu']} (SM{m['sm']}), driver {m.get('driver')}, torch {m['torch']}, "
             f"flashinfer {m['flashinfer']}, triton {m['triton']}, Python {m['python']}. Date {result['date']}.", "",
             f"Command: `{result['command']}`", "", "bf16, DeepSeek-V3 per-head dims (Dn=Dv=128, R=512, Dr=64), page 64.", "",
             "## plan (host, median ms)", "",
             "| step | N | batch | tokens | max kv | prepare (CSR + plan) | CSR build | FlashInfer plan() |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["plan"]:
        lines.append(f"| {r['kind']} | {r['N']} | {r['batch']} | {r['tokens']} | {r['max_kv']} | {r['prepare_ms']:.3f} | "
                     f"{r['csr_ms']:.3f} | {r['fi_plan_ms']:.3f} |")
    lines += ["", "## run (device, median µs; op = append + q·W_kn + FlashInfer + ·W_v)", "",
              "| N | batch | tokens | kv tokens | FlashInfer run() | TB/s | op (strided q/latent) | op (contiguous) | torch reference op | rel err vs torch |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    def fmt(v, spec):  # None / NaN = not measured
        return "n/a" if v is None or v != v else format(v, spec)

    for r in result["run"]:
        lines.append(f"| {r['N']} | {r['batch']} | {r['tokens']} | {r['kv_tokens']} | {fmt(r['fi_run_us'], '.1f')} | "
                     f"{fmt(r['fi_run_TBps'], '.2f')} | {fmt(r['op_strided_us'], '.1f')} | "
                     f"{fmt(r['op_contiguous_us'], '.1f')} | {fmt(r['torch_ref_us'], '.1f')} | "
                     f"{fmt(r['rel_err_strided'], '.1e')} |")
    lines += ["", f"## per step, {result['layers'][0]['layers'] if result['layers'] else 61} layers (wall clock, median ms)", "",
              "| N | batch | kv len | one plan + runs (this backend) | plan per layer + runs | runs only |",
              "|---|---|---|---|---|---|"]
    for r in result["layers"]:
        lines.append(f"| {r['N']} | {r['batch']} | {r['kv_len']} | {r['one_plan_ms']:.2f} | {r['per_layer_plans_ms']:.2f} | "
                     f"{r['runs_only_ms']:.2f} |")
    lines += ["", "## steps with prefill tokens: FlashInfer absorbed path vs Triton vs torch (eager, median µs)", "",
              "| case | N | seqs | tokens | FlashInfer (absorbed) | Triton | torch reference | rel err FI / Triton (vs) |",
              "|---|---|---|---|---|---|---|---|"]

    def cell(r, nm):
        v = r.get(f"{nm}_us")
        return "n/a" if v is None else f"{v:.1f}"

    for r in result["route"]:
        errs = "/".join(f"{r[k]:.1e}" if r.get(k) is not None else "-" for k in ("flashinfer_mla_rel_err", "triton_rel_err"))
        lines.append(f"| {r['case']} | {r['N']} | {r['seqs']} | {r['tokens']} | {cell(r, 'flashinfer_mla')} | "
                     f"{cell(r, 'triton')} | {cell(r, 'torch')} | {errs} ({r.get('err_vs')}) |")
    whys = sorted({f"{k[:-4]}: {v}" for r in result["route"] for k, v in r.items() if k.endswith("_why")})
    lines += [f"- not timed: {w}" for w in whys]
    lines += ["", "## decode in CUDA graphs (device time per replay, median µs) vs the same ops launched eagerly", "",
              "| N | batch | kv len | layers | FlashInfer graph | FlashInfer eager | Triton graph | Triton eager |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["graph"]:
        f = lambda k: "n/a" if r.get(k) is None else f"{r[k]:.1f}"  # noqa: E731
        lines.append(f"| {r['N']} | {r['batch']} | {r['kv_len']} | {r['layers']} | {f('flashinfer_mla_graph_us')} | "
                     f"{f('flashinfer_mla_eager_us')} | {f('triton_graph_us')} | {f('triton_eager_us')} |")
    (out_dir / "flashinfer_plan.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        ls = result["layers"]
        labels = [f"N={r['N']} b={r['batch']}\nkv={r['kv_len']}" for r in ls]
        x = range(len(ls))
        for off, key, lab in ((-0.27, "one_plan_ms", "1 plan + runs"), (0, "per_layer_plans_ms", "plan per layer + runs"),
                              (0.27, "runs_only_ms", "runs only")):
            axes[0].bar([i + off for i in x], [r[key] for r in ls], width=0.27, label=lab)
        axes[0].set_xticks(list(x), labels)
        axes[0].set_ylabel("ms per step")
        axes[0].set_title(f"{ls[0]['layers'] if ls else 61}-layer decode step")
        axes[0].legend()
        pr = result["plan"]
        rr = result["run"]
        axes[1].bar([f"plan {r['kind']} N={r['N']} b={r['batch']}" for r in pr], [r["fi_plan_ms"] * 1e3 for r in pr],
                    label="plan() (host)")
        axes[1].bar([f"run N={r['N']} b={r['batch']} T={r['tokens']}" for r in rr],
                    [r["fi_run_us"] or 0 for r in rr], label="run() (device)")
        axes[1].set_ylabel("µs")
        axes[1].set_title("FlashInfer plan vs run")
        axes[1].tick_params(axis="x", labelsize=7, labelrotation=60)
        axes[1].legend()
        rt = [r for r in result["route"] if r.get("flashinfer_mla_us") and r.get("triton_us")]
        axes[2].barh([r["case"] for r in rt], [r["flashinfer_mla_us"] for r in rt], height=0.4, label="FlashInfer absorbed")
        axes[2].barh([i + 0.4 for i in range(len(rt))], [r["triton_us"] for r in rt], height=0.4, label="Triton")
        axes[2].set_xlabel("µs per layer (eager)")
        axes[2].set_title("steps with prefill tokens")
        axes[2].tick_params(axis="y", labelsize=7)
        axes[2].legend()
        fig.tight_layout()
        fig.savefig(out_dir / "flashinfer_plan.png", dpi=110)
    except Exception as e:  # plotting is optional
        print(f"plot skipped: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small cases, few repeats (smoke test)")
    ap.add_argument("--fake", action="store_true", help="use the CPU fake FlashInfer of the tests (dry run)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: plan,run,layers,route,graph")
    ap.add_argument("--replot", default=None, help="rewrite the .md/.png of --out from this JSON (no measuring)")
    a = ap.parse_args(argv)
    if a.replot:
        write_outputs(Path(a.out), json.loads(Path(a.replot).read_text()))
        return
    dev = torch.device(a.device)
    if a.fake:  # the tests' pure-torch FlashInfer; Target.detect then reports an SM90 GPU with 0.6.18.post1
        import pytest

        from autodeploy_mla.testing.fake_flashinfer import install_fake_flashinfer

        install_fake_flashinfer(pytest.MonkeyPatch(), "0.6.18.post1")
    vers = Target.detect(dev, 64).versions
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (fake FlashInfer)"
    sm = "".join(map(str, torch.cuda.get_device_capability(dev))) if dev.type == "cuda" else "-"
    driver = None
    if dev.type == "cuda":
        try:
            import subprocess

            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
        except Exception:
            pass
    skip = set(filter(None, a.skip.split(",")))
    result = {
        "machine": {"gpu": gpu, "sm": sm, "driver": driver, "torch": torch.__version__, "flashinfer": vers.get("flashinfer"),
                    "triton": vers.get("triton"), "python": platform.python_version(), "host_cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_flashinfer_plan.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "plan": [] if "plan" in skip else bench_plan(dev, a.quick),
        "run": [] if "run" in skip else bench_run(dev, a.quick),
        "layers": [] if "layers" in skip else bench_61_layers(dev, a.quick),
        "route": [] if "route" in skip else bench_route(dev, a.quick),
        "graph": [] if "graph" in skip else bench_graph(dev, a.quick),
    }
    write_outputs(Path(a.out), result)
    print((Path(a.out) / "flashinfer_plan.md").read_text())


if __name__ == "__main__":
    main()
