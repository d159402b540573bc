"""Block-FP8 weights end to end (issue 44, targets 2 and 3): the whole model in FP8 against bf16.

`--model v2_lite` (default): the published DeepSeek-V2-Lite config (benchmarks.lib V2_LITE) built in
three separate processes (so one build's memory, compile caches and CUDA graphs cannot touch another's),
random hashed weights, the passes at their defaults (`--override a.b=c` changes them in every build):

- `bf16`: 16-bit weights;
- `fp8`: the same config with DeepSeek-V3's `quantization_config` (e4m3, 128 x 128 blocks, dynamic
  activations) and `model.init: hashed` FP8 weights, the FP8 linears and MoE on the backends the build
  resolves (W8A8 kernels on a GPU);
- `dequant`: the `fp8` build again (same seed: the same FP8 weights) with every FP8 linear on the
  `torch` backend and the FP8 MoE on `torch_moe_experts_fp8`: both dequantize the FP8 blocks to bf16
  and compute in bf16 with unquantized activations. That is the 16-bit model whose weights are the
  FP8 weights dequantized, run through the same graph, so the comparison isolates the W8A8 kernels'
  activation quantization and arithmetic.

Timed (`bf16`, `fp8`), as benchmarks.lib.model_steps times steps for every end-to-end script:
- decode at `--batch` (64) sequences of `--context` cached tokens: the isolated step (wall, and device
  time from its first launch to its end: `time_decode`) and steps queued as the engine queues them
  (`time_decode_stream`), medians of `--steps`; target: FP8 device step <= 0.6x bf16;
- prefill: `--prefill-reps` (8) fresh prompts of `--prefill-tokens` (2048) queued back to back
  (`time_prefill_stream`): tokens/s; target: FP8 >= 1.4x bf16.

Accuracy (`fp8` vs `dequant`): `--prompts` random prompts, `--new-tokens` greedy tokens free-running
(positions identical, a divergence making every later position differ; runs identical), and the
logits of fixed random sequences prefilled in both (teacher-forced, the same input in both):
greedy picks identical, max and mean |logit error|, relative L2 error per position.

`--model mistral_small_4_119b`: the full published Mistral-Small-4-119B config with random block-FP8
weights on one GPU (one process): build time, peak GPU memory, cache capacity (pages and tokens the
allocator holds), then `autodeploy bench`'s in-process run (serving.bench run_in_process: tokens/s,
TTFT, TPOT) of `--num-requests` requests (prompts `--prompt-len`, outputs `--output-len`).

    python -m benchmarks.e2e.fp8_weights_e2e --out docs/benchmarks               # -> fp8_weights_e2e.{md,json,png}
    python -m benchmarks.e2e.fp8_weights_e2e --phases fp8,dequant --out /tmp/e  # some builds; others kept from --out
    python -m benchmarks.e2e.fp8_weights_e2e --model mistral_small_4_119b --out docs/benchmarks
    python -m benchmarks.e2e.fp8_weights_e2e --smoke --out /tmp/fp8e2e          # CPU, tiny dims (the test)

Results of phases not run are kept from an existing JSON in `--out` (same model), so the phases can
be split over several device calls. `--render` rewrites the markdown and plot from the JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.lib import (MISTRAL_SMALL_4_119B, V2_LITE, command, error_line, machine, profile_decode,
                            profile_prefill, pyplot, serving_bench, time_decode, time_decode_stream, time_prefill,
                            time_prefill_stream)

REPO = Path(__file__).resolve().parents[2]
STEM = "fp8_weights_e2e"
#: DeepSeek-V3's published quantization_config (config.json)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
DECODE_TARGET, PREFILL_TARGET = 0.6, 1.4
PHASES = ("bf16", "fp8", "dequant")
#: `dequant`: the FP8 build with every FP8 linear and MoE on the dequantize-then-bf16 reference ops
DEQUANT_OVERRIDES = ("transforms.resolve_fp8_linear.backend=torch", "transforms.fuse_moe.backend=torch")
#: --smoke: the published configs' structure at dims the CPU builds in seconds (block 32 divides them)
TINY_DIMS = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
             "v_head_dim": 16}


# ----------------------------------------------------------------------------- configs
def hf_config(args: argparse.Namespace, fp8: bool) -> dict[str, Any]:
    hf = copy.deepcopy(V2_LITE if args.model == "v2_lite" else MISTRAL_SMALL_4_119B)
    if args.smoke:
        hf.update(TINY_DIMS)
        if hf.get("q_lora_rank"):
            hf["q_lora_rank"] = 48
        hf["max_position_embeddings"] = 4096
        if "original_max_position_embeddings" in hf.get("rope_parameters", {}):
            hf["rope_parameters"] = {**hf["rope_parameters"], "original_max_position_embeddings": 256,
                                     "factor": 16.0}
            if "max_position_embeddings" in hf["rope_parameters"]:
                hf["rope_parameters"]["max_position_embeddings"] = 4096
    if fp8:
        hf["quantization_config"] = {**QUANT, "weight_block_size": [32, 32] if args.smoke else [128, 128]}
    return hf


def build_config(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """optimize()'s config for one phase: random hashed weights (the FP8 phases' generated as FP8)."""
    device = "cpu" if args.smoke else "cuda"
    model = {"hf_config": hf_config(args, phase != "bf16"), "init": "hashed", "seed": args.seed, "device": device,
             "dtype": "bfloat16" if device == "cuda" else "float32"}
    page = 16 if args.smoke else 64
    if args.model == "v2_lite":
        longest = max(args.context + args.warmup + 2 * args.steps + 16, args.prefill_tokens + 8,
                      args.seq_len + 8)
        runtime = {"max_batch_size": args.batch, "max_seq_len": longest,
                   "max_num_tokens": max(args.prefill_tokens, args.batch), "page_size": page,
                   "num_pages": 2 + args.batch * -(-longest // page)}
    else:  # the cache takes runtime.free_memory_fraction of what the weights leave: the capacity measured
        plen = serving_bench.parse_range(args.prompt_len)[1] + serving_bench.parse_range(args.output_len)[1]
        runtime = {"max_batch_size": args.batch, "max_seq_len": plen + 8, "max_num_tokens": args.max_num_tokens,
                   "page_size": page}
        if args.smoke:
            runtime["num_pages"] = 2 + args.batch * -(-(plen + 8) // page)
    return {"model": model, "runtime": runtime}


def build(args: argparse.Namespace, phase: str):
    from benchmarks.lib import optimize

    overrides = list(args.override) + (list(DEQUANT_OVERRIDES) if phase == "dequant" else [])
    return optimize(None, build_config(args, phase), overrides=overrides)


def args_of(data: dict[str, Any], key: str) -> Any:
    return data.get("args", {}).get(key)


def build_facts(om) -> dict[str, Any]:
    """Which backends the build resolved (attention, FP8 linears, MoE), from its pass reports."""
    facts: dict[str, Any] = {"attention": sorted({d.backend for d in om.ctx.artifacts.decisions})}
    for rec in om.history:
        if rec.name == "resolve_fp8_linear" and rec.enabled:
            counts: dict[str, int] = {}
            for d in rec.details.get("layers", []):
                counts[d["backend"]] = counts.get(d["backend"], 0) + 1
            facts["fp8_linears"] = counts
        elif rec.name in ("fuse_moe", "fuse_gemms") and rec.enabled:
            facts[rec.name] = rec.summary
    pw = getattr(om.runner, "piecewise", None)
    if pw is not None:  # how the steps run: a whole-graph decode CUDA graph, or pieces (and which failed)
        facts["graphs"] = {"decode_graph": pw.decode_graph, "pieces": len(pw.report),
                           "not_capturable": sum(1 for r in pw.report if r.get("not_capturable")),
                           "failures": {k: str(v)[:200] for k, v in list(pw.failures.items())[:5]}}
    facts["parameters"] = sum(p.numel() for p in om.eager_model.parameters())
    facts["weight_gib"] = sum(p.numel() * p.element_size() for p in om.eager_model.parameters()) / 2**30
    return facts


# ----------------------------------------------------------------------------- accuracy inputs
def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(2, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]


def forced_sequences(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Fixed random sequences both models prefill: their logits are compared position by position."""
    g = torch.Generator().manual_seed(args.seed + 2)
    return [torch.randint(2, vocab, (args.seq_len,), generator=g).tolist() for _ in range(args.prompts)]


def accuracy_outputs(om, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Greedy tokens of the prompts and the logits of the forced sequences, saved to `path` (CPU)."""
    t = time.perf_counter()
    tokens = om.generate(prompts(args, om.vocab_size), max_new_tokens=args.new_tokens, ignore_eos=True)
    logits = torch.stack([om.prefill_logits(s).float().cpu() for s in forced_sequences(args, om.vocab_size)])
    torch.save({"tokens": tokens, "logits": logits}, path)
    return {"accuracy_outputs": str(path), "accuracy_s": time.perf_counter() - t}


def compare(ref_path: Path, fp8_path: Path) -> dict[str, Any]:
    """FP8 (W8A8) against the dequantized reference: greedy agreement and logit errors."""
    ref, fp8 = torch.load(ref_path), torch.load(fp8_path)
    a, b = ref["tokens"], fp8["tokens"]
    n = sum(len(r) for r in a)
    same = 0
    prefix = []
    for ra, rb in zip(a, b):
        k = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        prefix.append(k)
        same += k  # after the first divergence every later position counts as different
    la, lb = ref["logits"], fp8["logits"]
    err = (lb - la).abs()
    rel = (lb - la).norm(dim=-1) / la.norm(dim=-1).clamp_min(1e-30)
    return {"positions": n, "positions_identical": same / max(1, n),
            "runs_identical": sum(x == y for x, y in zip(a, b)), "runs": len(a),
            "mean_agreeing_prefix": sum(prefix) / max(1, len(prefix)),
            "forced_positions": int(la.shape[0] * la.shape[1]),
            "picks_identical": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "logit_abs_err_max": float(err.max()), "logit_abs_err_mean": float(err.mean()),
            "logit_ref_abs_mean": float(la.abs().mean()), "logit_ref_std": float(la.std()),
            "logit_rel_l2_mean": float(rel.mean()), "logit_rel_l2_max": float(rel.max())}


# ----------------------------------------------------------------------------- children
def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_v2_phase(args: argparse.Namespace, phase: str, work: Path) -> dict[str, Any]:
    _reset_peak()
    t = time.perf_counter()
    om = build(args, phase)
    out: dict[str, Any] = {"phase": phase, "build_s": time.perf_counter() - t, **build_facts(om)}
    out["peak_gib_build"] = _peak_gib()
    t = time.perf_counter()
    om.warmup()
    out["warmup_s"] = time.perf_counter() - t
    print(f"[{phase}] built in {out['build_s']:.1f} s, warm-up {out['warmup_s']:.1f} s: {json.dumps(out)}", flush=True)
    if phase != "dequant":
        cuda = om.device.type == "cuda"
        out["decode"] = time_decode(om, args.batch, args.context, args.steps, args.warmup)
        out["decode"].update(time_decode_stream(om, args.batch, args.context, args.steps, args.warmup))
        if cuda:
            pre = time_prefill_stream(om, args.prefill_tokens, args.prefill_reps)
            ms = pre["stream_ms"]
        else:  # no device events: isolated prefills (the plumbing only)
            pre = time_prefill(om, args.prefill_tokens, max(1, args.prefill_reps - 1))
            ms = pre["step_ms"]
        out["prefill"] = {**pre, "tokens": args.prefill_tokens, "reps": args.prefill_reps,
                          "tokens_per_s": args.prefill_tokens / ms * 1e3}
        print(f"[{phase}] decode {out['decode']}, prefill {out['prefill']}", flush=True)
        if args.profile and cuda:  # where a decode step's device time goes, kernel by kernel
            out["decode_profile"] = profile_decode(om, args.batch, args.context)
            out["prefill_profile"] = profile_prefill(om, args.prefill_tokens)
            print(f"[{phase}] decode profile: {out['decode_profile']['kernel_ms']:.2f} ms of kernels, "
                  f"{out['decode_profile']['kernels_per_step']:.0f} per step; top: " + "; ".join(
                      f"{k['kernel'][:60]} {k['us']:.0f}us x{k['launches']:.0f}" for k in out["decode_profile"]["top"]),
                  flush=True)
    pw = getattr(om.runner, "piecewise", None)
    if pw is not None:  # how the timed steps ran: graph replays, eager fallbacks, bind misses, capture failures
        out["step_modes"] = {"stats": dict(pw.stats), "capture": pw.capture_stats,
                             "captured": pw.summary().get("captured"),  # which buckets have graphs
                             "failures": {k: str(v)[:200] for k, v in list(pw.failures.items())[:5]}}
        print(f"[{phase}] step modes {json.dumps(out['step_modes'])}", flush=True)
    if phase != "bf16" and not args.no_accuracy:
        out.update(accuracy_outputs(om, args, work / f"{phase}_outputs.pt"))
    out["peak_gib"] = _peak_gib()
    return out


def run_mistral(args: argparse.Namespace) -> dict[str, Any]:
    _reset_peak()
    free0 = torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else None
    t = time.perf_counter()
    om = build(args, "fp8")
    out: dict[str, Any] = {"phase": "serve", "build_s": time.perf_counter() - t, "free_gib_before": free0,
                           **build_facts(om)}
    out["peak_gib_build"] = _peak_gib()
    alloc = om.allocator
    out["cache"] = {"pages": alloc.num_usable, "page_size": alloc.page_size,
                    "tokens": alloc.num_usable * alloc.page_size,
                    "max_seq_len": om.seq_info.max_seq_len, "max_batch_size": om.seq_info.max_batch_size}
    if torch.cuda.is_available():
        out["allocated_gib_after_build"] = torch.cuda.memory_allocated() / 2**30
    print(f"[serve] built in {out['build_s']:.1f} s: {json.dumps(out)}", flush=True)
    t = time.perf_counter()
    om.warmup()
    out["warmup_s"] = time.perf_counter() - t
    lo_p, hi_p = serving_bench.parse_range(args.prompt_len)
    lo_o, hi_o = serving_bench.parse_range(args.output_len)
    first = serving_bench.Workload.synthetic(min(8, args.num_requests), (lo_p, hi_p), (4, 4), om.vocab_size,
                                             seed=args.seed + 7)
    t = time.perf_counter()
    serving_bench.run_in_process(om, first)  # untimed: first uses of prefill shapes past the warm-up's
    out["first_pass_s"] = time.perf_counter() - t
    wl = serving_bench.Workload.synthetic(args.num_requests, (lo_p, hi_p), (lo_o, hi_o), om.vocab_size, seed=args.seed)
    wl.check_fits(om.seq_info.max_seq_len, args.model)
    out["workload"] = wl.description
    out["bench"] = serving_bench.run_in_process(om, wl)
    out["peak_gib"] = _peak_gib()
    return out


def child_main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    res = run_mistral(args) if args.model != "v2_lite" else run_v2_phase(args, args.child, work)
    print("CHILD_JSON " + json.dumps(res), flush=True)


def run_child(args: argparse.Namespace, argv: list[str], phase: str, work: Path) -> dict[str, Any]:
    """One build in its own process; its result is the last CHILD_JSON line it prints."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.e2e.fp8_weights_e2e", *argv, "--child", phase, "--work", str(work)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    result, tail = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("CHILD_JSON "):
            result = json.loads(line[len("CHILD_JSON "):])
        else:
            print(line, end="", flush=True)
            tail = (tail + [line.rstrip()])[-5:]
    rc = proc.wait()
    if rc != 0 or result is None:
        return {"phase": phase, "error": f"exit {rc}: " + " | ".join(tail), "seconds": time.perf_counter() - t}
    result["seconds"] = time.perf_counter() - t
    return result


# ----------------------------------------------------------------------------- report
def summarize(data: dict[str, Any]) -> None:
    """Ratios against the targets (FP8 / bf16 in the same run) into data['summary']."""
    ph = data["phases"]
    s: dict[str, Any] = {}
    b, f = ph.get("bf16", {}), ph.get("fp8", {})
    bd, fd = b.get("decode", {}), f.get("decode", {})
    for key in ("device_ms", "stream_ms", "step_ms"):
        if bd.get(key) and fd.get(key):
            s[f"decode_{key}_ratio"] = fd[key] / bd[key]
    if b.get("prefill") and f.get("prefill"):
        s["prefill_ratio"] = f["prefill"]["tokens_per_s"] / b["prefill"]["tokens_per_s"]
    key = next((k for k in ("device_ms", "stream_ms", "step_ms") if f"decode_{k}_ratio" in s), None)
    if key:
        s["decode_metric"] = key
        s["decode_ok"] = s[f"decode_{key}_ratio"] <= DECODE_TARGET
    if "prefill_ratio" in s:
        s["prefill_ok"] = s["prefill_ratio"] >= PREFILL_TARGET
    data["summary"] = s


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "" if x is None else fmt.format(x)


def render(data: dict[str, Any], out: Path) -> None:
    m = data["machine"]
    lines = ["# Block-FP8 weights end to end" + (" (smoke: tiny dims, CPU)" if data.get("smoke") else ""), "",
             f"`{m['command']}` on {m['gpu']} (torch {m['torch']}, triton {m['triton']}, flashinfer "
             f"{m['flashinfer']}), {m['date']}, commit {data.get('commit') or '?'}.", ""]
    if data["model"] == "v2_lite":
        a = data["args"]
        lines += [
            "DeepSeek-V2-Lite (published config), random hashed weights; each build in its own process. `fp8`: "
            "DeepSeek-V3's quantization_config (e4m3, 128 x 128 blocks, dynamic per-token activations), W8A8 on the "
            "backends the build resolved; `dequant`: the same FP8 weights dequantized to bf16 (FP8 linears on the "
            "`torch` backend, MoE on `torch_moe_experts_fp8`), the accuracy reference.", "",
            f"Decode: batch {a['batch']} x {a['context']} cached tokens, median of {a['steps']} steps (device: first "
            f"launch to end of the step; stream: steps queued as the engine queues them). Prefill: {a['prefill_reps']} "
            f"prompts of {a['prefill_tokens']} tokens queued back to back. Targets (issue 44): decode <= "
            f"{DECODE_TARGET}x bf16, prefill >= {PREFILL_TARGET}x bf16.", "",
            "| build | build s | weights GiB | peak GiB | decode device ms | decode stream ms | decode wall ms | "
            "prefill tok/s | FP8 linears | MoE | error |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for name in PHASES:
            r = data["phases"].get(name)
            if r is None:
                continue
            d, p = r.get("decode", {}), r.get("prefill", {})
            lin = ", ".join(f"{v} {k}" for k, v in sorted(r.get("fp8_linears", {}).items()))
            lines.append(f"| {name} | {_f(r.get('build_s'), '{:.0f}')} | {_f(r.get('weight_gib'), '{:.1f}')} | "
                         f"{_f(r.get('peak_gib'), '{:.1f}')} | {_f(d.get('device_ms'))} | {_f(d.get('stream_ms'))} | "
                         f"{_f(d.get('step_ms'))} | {_f(p.get('tokens_per_s'), '{:.0f}')} | {lin} | "
                         f"{r.get('fuse_moe', '')} | {r.get('error', '')} |")
        s = data.get("summary", {})
        lines += [""]
        if "decode_metric" in s:
            k = s["decode_metric"]
            lines.append(f"**Decode FP8 / bf16 ({k}): {s[f'decode_{k}_ratio']:.3f}** (target <= {DECODE_TARGET}: "
                         f"{'met' if s['decode_ok'] else 'missed'}); other measures: "
                         + ", ".join(f"{kk.removeprefix('decode_').removesuffix('_ratio')} {v:.3f}"
                                     for kk, v in s.items() if kk.startswith("decode_") and kk.endswith("_ratio")))
        if "prefill_ratio" in s:
            lines.append(f"**Prefill FP8 / bf16 tokens/s: {s['prefill_ratio']:.3f}** (target >= {PREFILL_TARGET}: "
                         f"{'met' if s['prefill_ok'] else 'missed'})")
        acc = data.get("accuracy")
        if acc:
            lines += ["", f"Accuracy, FP8 (W8A8) against the dequantized bf16 reference: {acc['runs']} prompts of "
                      f"{a['prompt_tokens']} tokens x {a['new_tokens']} greedy tokens; logits of {acc['forced_positions']} "
                      "positions of fixed random sequences prefilled in both.", "",
                      "| positions identical (free-running) | runs identical | mean agreeing prefix | picks identical "
                      "(forced) | max abs logit err | mean abs logit err | mean abs ref logit | rel L2 mean / max |",
                      "|---:|---:|---:|---:|---:|---:|---:|---|",
                      f"| {100 * acc['positions_identical']:.1f}% | {acc['runs_identical']}/{acc['runs']} | "
                      f"{acc['mean_agreeing_prefix']:.1f} | {100 * acc['picks_identical']:.1f}% | "
                      f"{acc['logit_abs_err_max']:.4g} | {acc['logit_abs_err_mean']:.4g} | {acc['logit_ref_abs_mean']:.4g} | "
                      f"{acc['logit_rel_l2_mean']:.4g} / {acc['logit_rel_l2_max']:.4g} |"]
        elif data.get("accuracy_note"):
            lines += ["", data["accuracy_note"]]
        profs = {f"{n} decode": r["decode_profile"] for n, r in data["phases"].items() if r.get("decode_profile")}
        profs.update({f"{n} prefill": r["prefill_profile"] for n, r in data["phases"].items() if r.get("prefill_profile")})
        if profs:
            lines += ["", f"Step kernels (`--profile`: torch.profiler over 5 decode steps of batch {args_of(data, 'batch')} "
                      f"at context {args_of(data, 'context')} and 3 prefills of {args_of(data, 'prefill_tokens')} tokens; "
                      "µs and launches per step, the top kernels by time):", ""]
            for name, pr in profs.items():
                lines += [f"**{name}**: {pr['kernel_ms']:.2f} ms of kernels, {pr['kernels_per_step']:.0f} per step", "",
                          "| kernel | µs | launches |", "|---|---:|---:|"]
                lines += [f"| `{k['kernel'][:90]}` | {k['us']:.0f} | {k['launches']:.0f} |" for k in pr.get("top", [])]
                lines.append("")
        graphs = {n: r["graphs"] for n, r in data["phases"].items() if r.get("graphs")}
        if graphs:
            lines += ["", "How the steps ran: " + "; ".join(
                f"{n}: decode graph {g['decode_graph']}, {g['pieces']} pieces, {g['not_capturable']} not capturable"
                + (f", failures {g['failures']}" if g.get("failures") else "") for n, g in graphs.items())]
    else:
        r = data["phases"].get("serve", {})
        c, bench = r.get("cache", {}), r.get("bench", {})
        lines += [
            "Mistral-Small-4-119B (full published config, 119 B parameters) with random block-FP8 weights (128 x 128, "
            "`init: hashed`) on one GPU, passes at their defaults; the cache takes `runtime.free_memory_fraction` of "
            "the memory the weights leave.", "",
            "| build s | weights GiB | peak GiB (build / run) | cache pages x page | cache tokens | warm-up s | "
            "tokens/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | error |",
            "|---:|---:|---|---|---:|---:|---:|---|---|---|",
            f"| {_f(r.get('build_s'), '{:.0f}')} | {_f(r.get('weight_gib'), '{:.1f}')} | "
            f"{_f(r.get('peak_gib_build'), '{:.1f}')} / {_f(r.get('peak_gib'), '{:.1f}')} | "
            f"{c.get('pages', '')} x {c.get('page_size', '')} | {c.get('tokens', '')} | {_f(r.get('warmup_s'), '{:.0f}')} | "
            f"{_f(bench.get('tokens_per_s'), '{:.0f}')} | {_f(bench.get('ttft_ms', {}).get('p50'), '{:.0f}')} / "
            f"{_f(bench.get('ttft_ms', {}).get('p90'), '{:.0f}')} | {_f(bench.get('tpot_ms', {}).get('p50'), '{:.1f}')} / "
            f"{_f(bench.get('tpot_ms', {}).get('p90'), '{:.1f}')} | {r.get('error', '')} |", "",
            f"Workload: {r.get('workload', '')}. FP8 linears: "
            + ", ".join(f"{v} {k}" for k, v in sorted(r.get("fp8_linears", {}).items())) + f"; MoE: {r.get('fuse_moe', '')}."]
    out.mkdir(parents=True, exist_ok=True)
    stem = data["stem"]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    plot(data, out / f"{stem}.png")


def plot(data: dict[str, Any], path: Path) -> None:
    if data["model"] != "v2_lite":
        return
    ph = {k: v for k, v in data["phases"].items() if k in ("bf16", "fp8") and "decode" in v}
    plt = pyplot() if ph else None
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    names = list(ph)
    key = data.get("summary", {}).get("decode_metric", "step_ms")
    dec = [ph[n]["decode"].get(key) or 0 for n in names]
    ax1.bar(names, dec, color=["tab:gray", "tab:blue"][: len(names)])
    if "bf16" in ph:
        ax1.axhline(DECODE_TARGET * (ph["bf16"]["decode"].get(key) or 0), color="k", ls="--", lw=0.8,
                    label=f"target {DECODE_TARGET}x bf16")
        ax1.legend(fontsize=7)
    ax1.set_ylabel(f"decode step, {key}")
    ax1.set_title(f"decode, batch {data['args']['batch']}")
    pre = [ph[n]["prefill"]["tokens_per_s"] for n in names]
    ax2.bar(names, pre, color=["tab:gray", "tab:blue"][: len(names)])
    if "bf16" in ph:
        ax2.axhline(PREFILL_TARGET * ph["bf16"]["prefill"]["tokens_per_s"], color="k", ls="--", lw=0.8,
                    label=f"target {PREFILL_TARGET}x bf16")
        ax2.legend(fontsize=7)
    ax2.set_ylabel("prefill tokens/s")
    ax2.set_title(f"prefill, {data['args']['prefill_tokens']}-token prompts")
    fig.suptitle("DeepSeek-V2-Lite, block-FP8 vs bf16 weights")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ----------------------------------------------------------------------------- main
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v2_lite", choices=["v2_lite", "mistral_small_4_119b"])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--phases", default=",".join(PHASES), help="v2_lite: which builds to run (bf16, fp8, dequant)")
    ap.add_argument("--override", action="append", default=[], help="a.b=c config override for every build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-reps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="accuracy: prompts (and forced sequences)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64, help="accuracy: length of the forced sequences")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--profile", action="store_true", help="v2_lite: also profile decode steps (top kernels per phase)")
    ap.add_argument("--num-requests", type=int, default=64, help="mistral: bench requests")
    ap.add_argument("--prompt-len", default="256:2048", help="mistral: bench prompt lengths")
    ap.add_argument("--output-len", default="128", help="mistral: bench output lengths")
    ap.add_argument("--max-num-tokens", type=int, default=2048, help="mistral: runtime.max_num_tokens")
    ap.add_argument("--commit", default="", help="recorded in the report")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: the script itself")
    ap.add_argument("--render", action="store_true", help="rewrite the markdown and plot from --out's JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.steps, args.warmup = 4, 32, 2, 1
        args.prefill_tokens, args.prefill_reps, args.prompts, args.prompt_tokens = 32, 2, 2, 8
        args.new_tokens, args.seq_len, args.num_requests, args.prompt_len = 4, 16, 3, "8:24"
        args.output_len, args.max_num_tokens = "4", 32
    return args


def main(argv: Optional[list[str]] = None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    if args.child:
        child_main(args)
        return
    stem = STEM if args.model == "v2_lite" else f"{STEM}_{args.model}"
    path = args.out / f"{stem}.json"
    if args.render:
        render(json.loads(path.read_text()), args.out)
        return
    old = json.loads(path.read_text()) if path.exists() else {}
    data = {"stem": stem, "model": args.model, "smoke": args.smoke, "machine": machine(command(raw)),
            "commit": args.commit, "args": {k: v for k, v in vars(args).items() if k not in ("out", "child", "work")},
            "phases": dict(old.get("phases", {})) if old.get("model") == args.model and old.get("smoke") == args.smoke
            else {}}
    phases = [p for p in args.phases.split(",") if p] if args.model == "v2_lite" else ["serve"]
    unknown = [p for p in phases if p not in (*PHASES, "serve")]
    if unknown:
        raise SystemExit(f"--phases {args.phases}: unknown {unknown}; valid: {', '.join(PHASES)}")
    work = Path(tempfile.mkdtemp(prefix="fp8e2e_"))
    t0 = time.time()
    for phase in phases:
        print(f"=== {args.model} {phase}", flush=True)
        data["phases"][phase] = run_child(args, raw, phase, work)
        gc.collect()
        # saved after every phase: a call that runs out of time keeps the phases it finished
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    if args.model == "v2_lite":
        summarize(data)
        ref, fp8 = data["phases"].get("dequant", {}), data["phases"].get("fp8", {})
        paths = [Path(p) for p in (ref.get("accuracy_outputs"), fp8.get("accuracy_outputs")) if p]
        if len(paths) == 2 and all(p.exists() for p in paths):
            try:
                data["accuracy"] = compare(*paths)
            except Exception as e:  # noqa: BLE001 - the timings stand without it
                data["accuracy_note"] = f"accuracy comparison failed: {error_line(e)}"
        elif old.get("accuracy") and not {"fp8", "dequant"} & set(phases):
            data["accuracy"] = old["accuracy"]
        else:
            data["accuracy_note"] = ("accuracy not measured in this run: the fp8 and dequant phases must run in the "
                                     "same invocation (their outputs are compared in a temporary directory)")
    data["seconds"] = time.time() - t0
    render(data, args.out)
    print(f"wrote {args.out}/{stem}.{{md,json,png}} in {data['seconds']:.0f} s")
    print("\n".join((args.out / f"{stem}.md").read_text().splitlines()[-12:]))


if __name__ == "__main__":
    main()
