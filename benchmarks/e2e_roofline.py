"""Whole-model decode and prefill against the hardware floor (issue 13).

For each model config (bf16, random weights) and each variant of the passes (`--variants`: `base`,
or '+'-joined switches: `inductor` = static pieces through Inductor, `moe` = the fuse_moe pass, ...),
after `om.warmup()`:

- decode, batch B x context C (every sequence adds one token; caches filled with random latents):
  median wall time per step through `ModelRunner` (metadata, plans, graph or CUDA-graph replay, the
  argmax sync) and the step's device time (CUDA events). Floor = bytes / measured copy bandwidth,
  bytes = the weights the step reads (every non-expert weight, the lm_head, the embedding rows, and
  per MoE layer the routed experts a batch of B tokens is expected to touch under uniform routing,
  E * (1 - (1 - k/E)^B)) + the latent cache (B * C * (R + Dr) * 2 bytes per layer; 1 with the `fp8` variant: e4m3 cache).
- prefill, one fresh sequence of T tokens in one step: median wall time; floor = FLOPs / measured
  bf16 GEMM peak, FLOPs = 2 * T * (non-expert weights without the embedding table and lm_head +
  k routed experts per MoE layer) + the lm_head for one row + causal attention in the expanded form,
  2 * N * T(T+1)/2 * (Dn + Dr + Dv) per layer. `% of peak` = floor / measured.
- queued columns: decode steps queued as the engine queues them with overlap (`--decode-stream`:
  step i+1 launched before step i's ids are collected, its tokens taken on the device), and fresh
  prefills queued back to back (`--prefill-stream`); GPU time per step from CUDA events. These are
  the serving engine's steady state; the isolated columns also pay each step's host work with the
  GPU idle. Variant parts: `inductor`, `moe`, `gemms` (fuse_gemms), `routing` (fuse_routing after
  the model's gate GEMM), `gate` (fuse_routing with the gate GEMM in the op, the default config's
  choice), `shared` (the shared expert in the fused op), `triton` (every layer on the Triton MLA
  backend; unnamed, the default backend choice), `rope` (real_rope); every other part not named is off.

Peaks are measured in the same process: copy bandwidth as 2 x bytes / time of a 4 GiB device-to-
device copy (read + write), bf16 peak as an 8192^3 matmul; both the median of 20 runs.

Each model/variant runs in a fresh child process by default (`--isolate`; its run records the peaks
that process measured): on an H200 the second model built in one process measured ~0.2 ms per decode
step slower than the first, the same variant twice included (docs/benchmarks/e2e_roofline.md,
2026-11-26 sixth session). `--no-isolate` runs them all in this process, as before.

    python benchmarks/e2e_roofline.py --out /tmp/roofline                        # on the GPU
    python benchmarks/e2e_roofline.py --render docs/benchmarks/e2e_roofline.json # md + png (CPU ok)
    python benchmarks/e2e_roofline.py --quick --device cpu --out /tmp/roofline   # plumbing dry run
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from deepseek_shape import GLM_47_FLASH, V2_LITE, v3_4layer  # noqa: E402
from e2e_decode import fill_ours, run_ours  # noqa: E402

MODELS = {"v2_lite": lambda: V2_LITE, "glm_4_7_flash": lambda: GLM_47_FLASH, "v3_4layer": v3_4layer}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_ms(fn, dev: torch.device, reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def measure_peaks(dev: torch.device, quick: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul TFLOP/s on this device."""
    nbytes = (64 if quick else 4096) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), dev)
    bw = 2 * nbytes / (ms / 1e3) / 1e9
    n = 512 if quick else 8192
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=dev)
    b = torch.randn(n, n, dtype=dt, device=dev)
    ms = _median_ms(lambda: a @ b, dev)
    return {"copy_gb_s": bw, "matmul_tflops": 2 * n**3 / (ms / 1e3) / 1e12, "matmul_n": n}


# ----------------------------------------------------------------------------- model accounting
def weight_accounting(model: torch.nn.Module) -> dict[str, Any]:
    """Bytes and parameter counts the floors need, from the eager model's parameters."""
    cfg = model.config
    n_exp = getattr(cfg, "n_routed_experts", None) or 0
    out: dict[str, Any] = {"total_bytes": 0, "embed_row_bytes": 0, "lm_head_bytes": 0, "lm_head_params": 0,
                           "dense_bytes": 0, "dense_params_no_vocab": 0}
    expert_params: dict[str, int] = {}  # MoE layer -> routed-expert parameters (all experts)
    for name, p in model.named_parameters():
        nb = p.numel() * p.element_size()
        out["total_bytes"] += nb
        if name.endswith("embed_tokens.weight"):
            out["embed_row_bytes"] = p.shape[1] * p.element_size()
        elif name.startswith("lm_head"):
            out["lm_head_bytes"], out["lm_head_params"] = nb, p.numel()
        elif ".mlp.experts." in name and n_exp and p.shape[0] == n_exp:
            layer = name.split(".mlp.experts.")[0]
            expert_params[layer] = expert_params.get(layer, 0) + p.numel()
        else:
            out["dense_bytes"] += nb
            out["dense_params_no_vocab"] += p.numel()
    elem = next(model.parameters()).element_size()
    out["expert_params_per_expert"] = [v / n_exp for v in expert_params.values()]
    out["expert_bytes_per_expert_layer"] = [v / n_exp * elem for v in expert_params.values()]
    out["n_experts"] = n_exp
    out["top_k"] = getattr(cfg, "num_experts_per_tok", 0) or 0
    return out


def mla_dims_of(model: torch.nn.Module) -> dict[str, int]:
    c = model.config
    return {"N": c.num_attention_heads, "R": c.kv_lora_rank, "Dr": c.qk_rope_head_dim, "Dn": c.qk_nope_head_dim,
            "Dv": c.v_head_dim, "layers": c.num_hidden_layers}


def decode_floor_bytes(w: dict[str, Any], dims: dict[str, int], batch: int, context: int,
                       cache_elem_bytes: int = 2) -> dict[str, float]:
    e, k = w["n_experts"], w["top_k"]
    touched = e * (1 - (1 - k / e) ** batch) if e else 0.0
    weights = (w["dense_bytes"] + w["lm_head_bytes"] + batch * w["embed_row_bytes"]
               + sum(touched * b for b in w["expert_bytes_per_expert_layer"]))
    cache = batch * context * (dims["R"] + dims["Dr"]) * cache_elem_bytes * dims["layers"]
    return {"weight_bytes": weights, "cache_bytes": cache, "experts_touched": touched}


def prefill_flops(w: dict[str, Any], dims: dict[str, int], tokens: int) -> float:
    active = w["dense_params_no_vocab"] + w["top_k"] * sum(w["expert_params_per_expert"])
    lin = 2 * tokens * active + 2 * w["lm_head_params"]
    attn = 2 * dims["N"] * tokens * (tokens + 1) / 2 * (dims["Dn"] + dims["Dr"] + dims["Dv"]) * dims["layers"]
    return lin + attn


# ----------------------------------------------------------------------------- timing
def time_decode(om, batch: int, context: int, steps: int, warmup: int) -> dict[str, float]:
    """Median wall and device time of a decode step (e2e_decode.run_ours with the runner as built)."""
    fill_ours(om, batch, context, warmup + steps + 8)
    try:
        r = run_ours(om, om.runner.piecewise, batch, context, steps, warmup, profile=False)
    finally:
        for sid in list(om.runner.allocator.owners()):
            om.runner.allocator.free(sid)
    return {k: r[k] for k in ("step_ms", "device_ms") if k in r}


def time_prefill(om, tokens: int, reps: int) -> dict[str, float]:
    from autodeploy_mla.runtime.sequence_info import StepSequence

    runner = om.runner
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, om.vocab_size, (tokens,), generator=g).tolist()
    ts = []
    for i in range(reps + 1):
        runner.allocator.ensure(0, tokens)
        try:
            _sync(om.device)
            t0 = time.perf_counter()
            _, logits = runner.forward([StepSequence(0, ids, 0)], runner.allocator.pages_of)
            logits[0, :1].argmax(-1).tolist()
            if i:  # the first is a warm-up
                ts.append((time.perf_counter() - t0) * 1e3)
        finally:
            runner.allocator.free(0)
    return {"step_ms": statistics.median(ts)}


def time_prefill_stream(om, tokens: int, steps: int) -> dict[str, float]:
    """Fresh prefills of `tokens` tokens queued back to back, as the engine runs a queue of prompts:
    `ModelRunner.launch` without waiting, so the host prepares step i+1 while the GPU runs step i.
    Per step: the GPU time from the end of the first step to the end of the last, over steps - 1
    (CUDA events; any wait for the host in between counts). The isolated step of `time_prefill`
    also pays its host preparation with the GPU idle."""
    from autodeploy_mla.runtime.sequence_info import StepSequence

    runner = om.runner
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, om.vocab_size, (tokens,), generator=g).tolist()
    timed, runner.time_steps = runner.time_steps, True
    launched = []
    try:
        _sync(om.device)
        for _ in range(steps):
            runner.allocator.ensure(0, tokens)  # the same pages each step: the stream orders the steps
            try:
                launched.append(runner.launch([StepSequence(0, ids, 0)], runner.allocator.pages_of, {}))
            finally:
                runner.allocator.free(0)
        for step in launched:
            runner.collect(step)
    finally:
        runner.time_steps = timed
    per = launched[0].done.elapsed_time(launched[-1].done) / (steps - 1)
    dev = [s.device_ms() for s in launched[1:]]
    return {"stream_ms": per, "stream_device_ms": statistics.median(d for d in dev if d is not None)}


def time_decode_stream(om, batch: int, context: int, steps: int, warmup: int = 3) -> dict[str, float]:
    """Decode steps queued as the engine queues them (runtime/engine.py, overlap on): step i+1 is
    launched before step i's ids are collected, its tokens taken on the device from step i's
    sampled rows (`StepSequence.src_row`), so scheduling, metadata and backend prepare of step i+1
    run while the GPU computes step i. Per step: GPU time from the end of the first step to the end of
    the last over steps - 1 (CUDA events; any wait for the host in between counts). This is the
    inter-token time of a batch in steady state; `time_decode` also pays each step's host work and
    sampling sync with the GPU idle. The first `warmup` steps are not timed (first uses of the
    device-token path)."""
    from autodeploy_mla.runtime.sequence_info import StepSequence

    runner = om.runner
    steps += warmup
    fill_ours(om, batch, context, steps + 8)
    timed, runner.time_steps = runner.time_steps, True
    launched = []
    pos0 = context
    try:
        _sync(om.device)
        prev = None
        for i in range(steps):
            if prev is None:
                seqs = [StepSequence(s, [1], pos0 + i) for s in range(batch)]
            else:
                row = {sid: r for r, sid in enumerate(prev.order)}
                seqs = [StepSequence(s, [0], pos0 + i, src_row=row[s]) for s in range(batch)]
            cur = runner.launch(seqs, runner.allocator.pages_of, {})
            if prev is not None:
                runner.collect(prev)
            launched.append(cur)
            prev = cur
        runner.collect(prev)
    finally:
        runner.time_steps = timed
        for sid in list(runner.allocator.owners()):
            runner.allocator.free(sid)
    if launched[0].done is None:  # CPU (plumbing runs): no device events
        return {}
    per = launched[warmup].done.elapsed_time(launched[-1].done) / (steps - 1 - warmup)
    return {"stream_ms": per}


# ----------------------------------------------------------------------------- one model
#: Pass switches a variant name is made of ("inductor+moe"); "base" (or "none") is neither.
VARIANT_PARTS: dict[str, dict[str, dict[str, Any]]] = {
    "inductor": {"piecewise": {"compile": "inductor"}},
    "moe": {"fuse_moe": {"enabled": True, "shared_experts": "never"}},
    "shared": {"fuse_moe": {"enabled": True, "shared_experts": "always"}},  # the shared expert as expert E of the op
    "triton": {"insert_cached_mla_attention": {"backend": "triton"}},  # every layer on our Triton MLA backend
    "gemms": {"fuse_gemms": {"enabled": True}},
    "routing": {"fuse_routing": {"enabled": True, "gate_gemm": False}},  # the routing op after the model's gate GEMM
    "gate": {"fuse_routing": {"enabled": True, "gate_gemm": True}},  # the gate GEMM in the routing op too
    "rope": {"real_rope": {"enabled": True}},  # complex-number rotary products as real arithmetic (V2)
}


#: variant parts that set a backend policy instead of a pass option
POLICY_PARTS = ("absorbed",)  # absorbed: every FlashInfer prefill step on FlashInfer (no cost-model routing)
#: variant parts that set runtime keys
RUNTIME_PARTS: dict[str, dict[str, Any]] = {"fp8": {"kv_cache_dtype": "fp8_e4m3"}}  # e4m3 latent cache


def variant_policies(variant: str) -> dict[str, Any]:
    """Backend policies of a variant (`absorbed`: FlashInferPolicy(prefill="flashinfer"))."""
    from autodeploy_mla.custom_ops.flashinfer.mla import FlashInferPolicy

    parts = variant.split("+")
    return {"flashinfer_mla": FlashInferPolicy(prefill="flashinfer")} if "absorbed" in parts else {}


def variant_transforms(variant: str) -> dict[str, dict[str, Any]]:
    """Pass options of a variant: every switch of VARIANT_PARTS off unless named ("inductor+moe")."""
    parts = [p for p in variant.split("+") if p not in ("base", "none", "", *POLICY_PARTS, *RUNTIME_PARTS)]
    unknown = [p for p in parts if p not in VARIANT_PARTS]
    if unknown:
        raise ValueError(f"unknown variant part(s) {unknown}; known: base, {', '.join(VARIANT_PARTS)}, "
                         f"{', '.join(POLICY_PARTS)}, {', '.join(RUNTIME_PARTS)}")
    out: dict[str, dict[str, Any]] = {"piecewise": {"compile": "none"}, "fuse_moe": {"enabled": False},
                                      "fuse_gemms": {"enabled": False}, "fuse_routing": {"enabled": False},
                                      "real_rope": {"enabled": False}}
    for p in parts:
        for k, v in VARIANT_PARTS[p].items():
            out.setdefault(k, {}).update(v)
    return out


def build_model(name: str, variant: str, args: argparse.Namespace, transforms: Optional[dict[str, Any]] = None):
    """optimize() on the named config (bf16 random weights) sized for the script's batches, contexts and
    chunks; `variant` names the passes that are on (variant_transforms), `transforms` more pass options
    merged over it."""
    from autodeploy_mla import optimize

    hf = copy.deepcopy(MODELS[name]())
    if args.quick:
        hf.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=8,
                  num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=48 if hf.get("q_lora_rank") else None,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        if "mlp_layer_types" in hf:
            hf["mlp_layer_types"] = ["dense", "sparse"]
    max_len = max(args.contexts, default=0) + args.warmup + args.steps + 16
    page = 64 if not args.quick else 16
    batch, chunk = max(args.batches, default=1), max(args.chunks, default=1)  # either list may be empty
    cfg = {"model": {"hf_config": hf, "device": args.device,
                     "dtype": "bfloat16" if args.device != "cpu" else "float32"},
           "runtime": {"max_batch_size": batch, "max_seq_len": max(max_len, chunk + 8),
                       "max_num_tokens": max(chunk, batch), "page_size": page,
                       "num_pages": 2 + batch * -(-max(max_len, chunk + 8) // page)},
           "transforms": variant_transforms(variant)}
    for k, v in (transforms or {}).items():
        cfg["transforms"].setdefault(k, {}).update(v)
    for part in variant.split("+"):
        cfg["runtime"].update(RUNTIME_PARTS.get(part, {}))
    return optimize(None, cfg, backend_policies=variant_policies(variant))


def bench_model(name: str, variant: str, args: argparse.Namespace, peaks: dict[str, float]) -> dict[str, Any]:
    t = time.perf_counter()
    om = build_model(name, variant, args)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    om.warmup()
    warm_s = time.perf_counter() - t
    w = weight_accounting(om.eager_model)
    dims = mla_dims_of(om.eager_model)
    entry: dict[str, Any] = {
        "model": name, "variant": variant, "build_s": build_s, "warmup_s": warm_s,
        "parameters": sum(p.numel() for p in om.eager_model.parameters()), "dims": dims,
        "backends": sorted({d.backend for d in om.ctx.artifacts.decisions}),
        "passes": passes_on(om),
        "weights_gb": w["total_bytes"] / 1e9, "decode": [], "prefill": [],
        "cache_dtype": str(om.runner.compiled.signature.caches[0].spec.dtype).replace("torch.", ""),
        "cache_elem_bytes": om.runner.compiled.signature.caches[0].spec.dtype.itemsize,
    }
    bw = peaks["copy_gb_s"] * 1e9
    for b in args.batches:
        for c in args.contexts:
            r = time_decode(om, b, c, args.steps, args.warmup)
            if args.decode_stream > 1:
                r.update(time_decode_stream(om, b, c, args.decode_stream))
            fl = decode_floor_bytes(w, dims, b, c, entry["cache_elem_bytes"])
            floor_ms = (fl["weight_bytes"] + fl["cache_bytes"]) / bw * 1e3
            if "stream_ms" in r:
                r["stream_x_floor"] = r["stream_ms"] / floor_ms
            r.update(batch=b, context=c, floor_ms=floor_ms, x_floor=r["step_ms"] / floor_ms,
                     weight_gb=fl["weight_bytes"] / 1e9, cache_gb=fl["cache_bytes"] / 1e9,
                     experts_touched=fl["experts_touched"])
            entry["decode"].append(r)
            print(f"[{name}/{variant}] decode B={b} C={c}: {r['step_ms']:.2f} ms (device {r.get('device_ms', 0):.2f}), "
                  f"floor {floor_ms:.2f} ms, {r['x_floor']:.2f}x" + (f"; queued as the engine runs {r['stream_ms']:.2f} ms/step "
                                                                  f"= {r['stream_x_floor']:.2f}x" if "stream_ms" in r else ""),
                  flush=True)
    peak = peaks["matmul_tflops"] * 1e12
    for tkn in args.chunks:
        r = time_prefill(om, tkn, args.prefill_reps)
        if args.device != "cpu" and args.prefill_stream > 1:
            r.update(time_prefill_stream(om, tkn, args.prefill_stream))
        flops = prefill_flops(w, dims, tkn)
        floor_ms = flops / peak * 1e3
        r.update(tokens=tkn, tflop=flops / 1e12, floor_ms=floor_ms, pct_peak=100 * floor_ms / r["step_ms"],
                 tflops=flops / (r["step_ms"] / 1e3) / 1e12)
        if "stream_ms" in r:
            r.update(stream_pct_peak=100 * floor_ms / r["stream_ms"])
        entry["prefill"].append(r)
        print(f"[{name}/{variant}] prefill T={tkn}: {r['step_ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s = "
              f"{r['pct_peak']:.1f}% of peak" + (f"; queued back to back {r['stream_ms']:.2f} ms/step = "
                                                 f"{r['stream_pct_peak']:.1f}%" if "stream_ms" in r else ""),
              flush=True)
    del om
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return entry


def passes_on(om) -> dict[str, Any]:
    """What the build actually did, from its pass history (not from the variant's name)."""
    rec = {r.name: r for r in om.history}
    pw = rec.get("piecewise")
    moe = rec.get("fuse_moe")
    gemms = rec.get("fuse_gemms")
    routing = rec.get("fuse_routing")
    return {"piecewise_compile": pw.details.get("compile", "none") if pw is not None else "none",
            "cuda_graphs": om.device.type == "cuda",
            "fuse_moe": moe.summary if moe is not None and moe.enabled else "off",
            "fuse_gemms": gemms.summary if gemms is not None and gemms.enabled else "off",
            "fuse_routing": routing.summary if routing is not None and routing.enabled else "off",
            "fi_prefill": _fi_prefill(om)}


def _fi_prefill(om) -> str:
    """How the FlashInfer session routes prefill steps ("auto" = the prefill cost model)."""
    sess = om.runner.sessions.get("flashinfer_mla")
    return sess.policy.prefill if sess is not None else "n/a"


# ----------------------------------------------------------------------------- report
def render(path: Path) -> None:
    data = json.loads(path.read_text())
    meta = data["meta"]
    p = meta["peaks"]
    lines = ["# Whole model against the hardware floor (decode bytes, prefill FLOPs)", "",
             f"Machine: {meta.get('gpu')}, torch {meta.get('torch')}, transformers {meta.get('transformers')}. "
             f"Measured peaks: copy {p['copy_gb_s']:.0f} GB/s (read + write), bf16 matmul "
             f"{p['matmul_tflops']:.0f} TFLOP/s ({p['matmul_n']}^3).", "",
             f"Command: `{meta.get('command')}` (total {meta.get('total_s', 0):.0f} s).", ""]
    for c in meta.get("calls", []):  # a table merged from several calls: each with its own peaks
        cp = c["peaks"]
        lines += [f"- `{c['command']}` ({c.get('total_s', 0):.0f} s; peaks copy {cp['copy_gb_s']:.0f} GB/s, "
                  f"matmul {cp['matmul_tflops']:.0f} TFLOP/s){': ' + c['note'] if c.get('note') else ''}"]
    lines += ["", "Step times (ms) next to the ratios: the measured peaks differ by host (741-796 TFLOP/s bf16), "
              "so compare the milliseconds across rows of different calls.", "",
              "| model | variant | B1 C1k x floor (ms) | B64 C1k x floor (ms) | prefill 2048 % of peak (ms) |",
              "|---|---|---:|---:|---:|"]
    for e in data["runs"]:
        def pick(b: int, c: int) -> str:
            r = next((r for r in e["decode"] if (r["batch"], r["context"]) == (b, c)), None)
            if r is None:
                return "-"
            q = f"; queued {r['stream_x_floor']:.2f} ({r['stream_ms']:.2f})" if "stream_ms" in r else ""
            return f"{r['x_floor']:.2f} ({r['step_ms']:.2f}){q}"
        pf = next((f"{r['pct_peak']:.1f}% ({r['step_ms']:.2f})"
                   + (f"; queued {r['stream_pct_peak']:.1f}% ({r['stream_ms']:.2f})" if "stream_ms" in r else "")
                   for r in e["prefill"] if r["tokens"] == 2048), "-")
        lines.append(f"| {e['model']} | {e['variant']} | {pick(1, 1024)} | {pick(64, 1024)} | {pf} |")
    lines += ["", "Targets (issue 13): B64 C1k <= 1.4x, B1 <= 1.5x, prefill 2048 >= 50% on V2-Lite and GLM-4.7-Flash.",
              "",
             "Decode floor = (weights read: non-expert + lm_head + expected touched routed experts + embedding rows; "
             "plus the latent cache) / copy bandwidth. Prefill floor = FLOPs (active weights, expanded causal "
             "attention) / bf16 peak. Random weights, bf16; steps through ModelRunner with CUDA graphs.", ""]
    for e in data["runs"]:
        lines += [f"## {e['model']} — variant: {e['variant']}", "",
                  f"{e['parameters'] / 1e9:.2f} B parameters ({e['weights_gb']:.1f} GB), dims {e['dims']}, backends "
                  f"{e['backends']}, passes {e['passes']}; build {e['build_s']:.0f} s, warm-up {e['warmup_s']:.0f} s.",
                  "", "| decode B | context | step ms | device ms | floor ms | x floor | queued: ms/step | queued: x floor "
                  "| weights GB | cache GB |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in e["decode"]:
            q = f"{r['stream_ms']:.2f} | **{r['stream_x_floor']:.2f}**" if "stream_ms" in r else "- | -"
            lines.append(f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r.get('device_ms', 0):.2f} | "
                         f"{r['floor_ms']:.2f} | **{r['x_floor']:.2f}** | {q} | {r['weight_gb']:.1f} | {r['cache_gb']:.2f} |")
        lines += ["", "| prefill tokens | step ms | TFLOP | TFLOP/s | % of bf16 peak | queued: ms/step | queued: % of peak |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in e["prefill"]:
            q = (f"{r['stream_ms']:.2f} | **{r['stream_pct_peak']:.1f}%**" if "stream_ms" in r else "- | -")
            lines.append(f"| {r['tokens']} | {r['step_ms']:.2f} | {r['tflop']:.2f} | {r['tflops']:.0f} | "
                         f"**{r['pct_peak']:.1f}%** | {q} |")
        lines.append("")
    for err in data.get("errors", []):
        lines.append(f"- error: {err}")
    lines.append("![plot](e2e_roofline.png)")
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = data["runs"]
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    labels = [f"{e['model']}\n{e['variant']}" for e in runs]
    keys = sorted({(r["batch"], r["context"]) for e in runs for r in e["decode"]})
    for j, (b, c) in enumerate(keys):
        vals = [next((r["x_floor"] for r in e["decode"] if (r["batch"], r["context"]) == (b, c)), 0) for e in runs]
        axes[0].bar([i + (j - len(keys) / 2) * 0.8 / len(keys) for i in range(len(runs))], vals,
                    width=0.8 / len(keys), label=f"B{b} C{c}")
    axes[0].axhline(1.4, color="k", ls="--", lw=1)
    axes[0].set_title("decode step / floor (target <= 1.4 at B64 C1k)")
    axes[0].set_xticks(range(len(runs)), labels, fontsize=7)
    axes[0].legend(fontsize=7)
    chunks = sorted({r["tokens"] for e in runs for r in e["prefill"]})
    for j, t in enumerate(chunks):
        vals = [next((r["pct_peak"] for r in e["prefill"] if r["tokens"] == t), 0) for e in runs]
        axes[1].bar([i + (j - len(chunks) / 2) * 0.8 / len(chunks) for i in range(len(runs))], vals,
                    width=0.8 / len(chunks), label=f"T{t}")
    axes[1].axhline(50, color="k", ls="--", lw=1)
    axes[1].set_title("prefill: % of bf16 matmul peak (target >= 50 at T2048)")
    axes[1].set_xticks(range(len(runs)), labels, fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--models", default="v2_lite,glm_4_7_flash,v3_4layer")
    ap.add_argument("--variants", default="base,moe,inductor,inductor+moe",
                    help="comma-separated pass variants: base, or '+'-joined parts of " + ", ".join(VARIANT_PARTS))
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64])
    ap.add_argument("--contexts", type=_ints, default=[1024, 4096])
    ap.add_argument("--chunks", type=_ints, default=[512, 2048])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--prefill-stream", type=int, default=6,
                    help="fresh prefill steps queued back to back for the steady-state column (0: skip)")
    ap.add_argument("--decode-stream", type=int, default=12,
                    help="decode steps queued as the engine queues them (overlap) for the steady-state column (0: skip)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny dims of each config (plumbing check)")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="skip models that would start after this")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="run each model/variant in a fresh process (default): the second model built in one "
                         "process measured ~0.2 ms per decode step slower (H200, 2026-11-26)")
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    if args.out is None:
        ap.error("--out (or --render) is required")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    peaks = measure_peaks(dev, args.quick)
    print(f"peaks: {peaks}", flush=True)
    import transformers

    meta = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "peaks": peaks,
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"}
    data: dict[str, Any] = {"meta": meta, "runs": [], "errors": []}
    out = args.out / "e2e_roofline.json"
    pairs = [(name, variant) for name in args.models.split(",") for variant in args.variants.split(",")]
    isolate = args.isolate and len(pairs) > 1
    meta["isolated"] = isolate
    for i, (name, variant) in enumerate(pairs):
        if time.perf_counter() - t0 > args.time_budget_s:
            data["errors"].append(f"{name}/{variant}: skipped (over --time-budget-s {args.time_budget_s:g})")
            continue
        try:
            if isolate:
                runs, errors = _run_isolated(name, variant, args.out / f"run{i}")
                data["runs"] += runs
                data["errors"] += errors
            else:
                data["runs"].append(bench_model(name, variant, args, peaks))
        except Exception as exc:  # noqa: BLE001 - record and go on
            data["errors"].append(f"{name}/{variant}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        meta["total_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(data, indent=1))
    render(out)
    print((args.out / "e2e_roofline.md").read_text())


def _run_isolated(name: str, variant: str, out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One model/variant in a child process of this script (same arguments otherwise): its runs, each
    with the peaks its own process measured (its floors use them), and its errors."""
    import subprocess

    argv, skip = [], False
    for a in sys.argv[1:]:  # drop --models/--variants/--out (and their values) and --isolate
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in ("--models", "--variants", "--out"):
            skip = "=" not in a
            continue
        if key in ("--isolate", "--no-isolate"):
            continue
        argv.append(a)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--models", name, f"--variants={variant}",
           "--out", str(out), "--no-isolate"]
    print(f"[{name}/{variant}] in a fresh process: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, check=False)
    path = out / "e2e_roofline.json"
    if not path.exists():
        return [], [f"{name}/{variant}: child process exited {proc.returncode} without results"]
    child = json.loads(path.read_text())
    for run in child["runs"]:
        run["peaks"] = child["meta"]["peaks"]
    errors = list(child.get("errors", []))
    if proc.returncode:
        errors.append(f"{name}/{variant}: child process exited {proc.returncode}")
    return child["runs"], errors


if __name__ == "__main__":
    main()
