"""End-to-end decode step latency: HF eager vs ours eager vs ours piecewise + CUDA graphs.

Model: a DeepSeek-V3-shaped `transformers` DeepseekV3 model with the real per-layer MLA dims
(N 128, q_lora 1536, R 512, Dr 64, Dn 128, Dv 128, hidden 7168), a few layers (first dense, the rest
MoE with fewer/smaller routed experts than the real 256 x 2048 so it fits and builds in seconds),
vocab 32768, random weights, bf16. One decode step = every sequence of the batch adds one token at
context length C; the latency is wall clock per step including our host work (metadata build, one
H2D copy, backend prepare hooks, launches) and the sampling sync (argmax -> host), median over steps.

Variants:
  hf_eager            HF model(next_token, past_key_values=DynamicCache) (expanded K/V cache, cat per step)
  ours_eager[B]       our compiled graph (flat FX graph, backend B), every op launched eagerly
                      (the model runner with its piecewise runner taken away: steps unpadded)
  ours_cg[B]          the model runner as built (piecewise runner): decode-only steps replay one
                      whole-graph CUDA graph when every attention op is decode_graph_safe (triton,
                      flashinfer_mla), else static pieces replay per bucket and the attention op runs
                      eagerly in between (torch)
Both variants step through `ModelRunner.forward` (metadata build, backend session prepare hooks,
graph); the batches are the runner's token buckets, so no step is padded.
For ours_cg the sum of GPU kernel (+memcpy) times per step is read with torch.profiler, to show how
close the step latency is to the device work.

Our caches are filled with random latents directly (no prefill through the model: only decode is
timed); HF's DynamicCache is filled with random K/V the same way.

    python -m benchmarks.e2e.e2e_decode --out /tmp/e2e                   # on the GPU: writes e2e_decode.json
    python -m benchmarks.e2e.e2e_decode --render docs/benchmarks/e2e_decode.json   # table + plot (CPU ok)
    python -m benchmarks.e2e.e2e_decode --quick --device cpu --out /tmp/x          # dry run of the plumbing
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.lib import (
    build_hf,
    decode_runtime,
    deepseek_v3_shaped,
    extra_tokens,
    fill_ours,
    run_ours,
    step_stats,
    sync,
)


DEFAULT_BATCHES = (1, 8, 32, 64)
DEFAULT_CONTEXTS = (1024, 4096)


# ----------------------------------------------------------------------------- ours
def build_ours(model, backend: str, args, device):
    from benchmarks.lib import optimize

    cfg = {
        "runtime": decode_runtime(args, extra_tokens(args)),
        "transforms": {
            "insert_cached_mla_attention": {"backend": backend},
            "piecewise": {"enabled": True, "on_cpu": True, "buckets": sorted(set(args.batches)),
                          "compile": args.compile},
        },
    }
    return optimize(model, cfg)


# ----------------------------------------------------------------------------- HF
def _layer_kv(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def hf_cache_shapes(model, device) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per layer (key shape, value shape) of what HF's DynamicCache stores for ONE token of ONE sequence
    (transformers <= 5.2x caches expanded per-head K/V; later versions cache the latent)."""
    cache = _new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    out = []
    for layer in range(model.config.num_hidden_layers):
        k, v = _layer_kv(cache, layer)
        out.append(((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])))
    return out


def hf_cache_gb(shapes, batch: int, context: int) -> float:
    per_tok = sum(hk * dk + hv * dv for (hk, dk), (hv, dv) in shapes) * 2
    return batch * context * per_tok / 2**30


def run_hf(model, shapes, batch: int, context: int, steps: int, warmup: int, device) -> dict[str, Any]:
    cache = _new_cache(model)
    pos0 = context - warmup
    g = torch.Generator(device=device).manual_seed(context + batch)
    dtype = next(model.parameters()).dtype
    for layer, ((hk, dk), (hv, dv)) in enumerate(shapes):
        k = torch.randn(batch, hk, pos0, dk, device=device, dtype=dtype, generator=g)
        v = torch.randn(batch, hv, pos0, dv, device=device, dtype=dtype, generator=g)
        cache.update(k, v, layer)
        del k, v
    ids = torch.ones(batch, 1, dtype=torch.long, device=device)
    ts = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            sync(device)
            t0 = time.perf_counter()
            pos = torch.full((batch, 1), pos0 + i, dtype=torch.long, device=device)
            out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            nxt.tolist()  # the sampling sync
            ids = nxt[:, None]
            if i >= warmup:
                ts.append((time.perf_counter() - t0) * 1e3)
    del cache, out
    return step_stats(ts)


# ----------------------------------------------------------------------------- main
def environment(device) -> dict[str, Any]:
    from benchmarks.lib import library_versions

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    env.update({f"lib_{k}": v for k, v in library_versions().items()})
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update({"gpu": p.name, "sms": p.multi_processor_count, "gpu_mem_gb": round(p.total_memory / 2**30, 1),
                    "cuda": torch.version.cuda})
    return env


def backends_to_run(args, device) -> list[tuple[str, str]]:
    """[(backend, note)]: triton, flashinfer_mla if their check() accepts, else torch."""
    from benchmarks.lib import MLADims, Target, all_backends, get_backend

    dims = MLADims(args.heads, 128, 64, 128, 512)
    target = Target.detect(device, args.page_size)
    out = []
    for name in args.backends:
        if name not in all_backends():
            print(f"[skip] backend {name}: not registered", flush=True)
            continue
        res = get_backend(name).check(dims, torch.bfloat16 if device.type == "cuda" else torch.float32, target)
        if res.ok:
            out.append((name, res.reason))
        else:
            print(f"[skip] backend {name}: {res.reason}", flush=True)
    if not any(b == "triton" for b, _ in out) and "torch" not in [b for b, _ in out]:
        out.insert(0, ("torch", "fallback: triton backend unavailable"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/e2e_decode")
    ap.add_argument("--render", help="render table + plot from this JSON (no GPU needed) and exit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_BATCHES))
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_CONTEXTS))
    ap.add_argument("--backends", type=lambda s: s.split(","), default=["triton", "flashinfer_mla"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--compile", default="none", choices=["none", "inductor"])
    ap.add_argument("--hf-max-cache-gb", type=float, default=48.0, help="skip HF configs whose K/V cache is larger")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny dims for a CPU dry run of the plumbing")
    args = ap.parse_args(argv)
    if args.render:
        render(Path(args.render))
        return 0
    if args.quick:
        args.hidden, args.heads, args.intermediate, args.moe_intermediate, args.vocab = 256, 4, 256, 64, 512
        args.experts, args.layers, args.page_size, args.steps, args.warmup = 4, 2, 16, 3, 1
        args.batches, args.contexts = [1, 4], [32]

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = deepseek_v3_shaped(args)
    result: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(device),
        "model": cfg,
        "dtype": str(dtype).replace("torch.", ""),
        "rows": [],
        "notes": [],
        "runners": {},
    }
    path = out_dir / "e2e_decode.json"

    def save():
        path.write_text(json.dumps(result, indent=1, default=str))

    t_start = time.perf_counter()
    model = build_hf(cfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    result["model_params"] = n_params
    print(f"model: {n_params / 1e9:.2f} B params, built in {time.perf_counter() - t_start:.1f}s", flush=True)
    extra = extra_tokens(args)

    def run_backend(backend: str, why: str) -> None:
        t0 = time.perf_counter()
        om = build_ours(model, backend, args, device)
        build_s = time.perf_counter() - t0
        piecewise = om.runner.piecewise
        print(f"[{backend}] built in {build_s:.1f}s: {om.history[-1].summary}", flush=True)
        result["notes"].append(f"{backend}: {why}; build {build_s:.1f}s; {om.history[-1].summary}")
        for context in args.contexts:
            for batch in args.batches:
                fill_ours(om, batch, context, extra)
                for variant, pw in (("ours_eager", None), ("ours_cg", piecewise)):
                    t1 = time.perf_counter()
                    try:
                        res = run_ours(om, pw, batch, context, args.steps, args.warmup, profile=variant == "ours_cg")
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    res.update({"variant": variant, "backend": backend, "batch": batch, "context": context,
                                "wall_s": round(time.perf_counter() - t1, 2)})
                    if "step_ms" in res:
                        res["tokens_per_s"] = batch / res["step_ms"] * 1e3
                        if "kernel_ms" in res:
                            res["latency_over_kernels"] = res["step_ms"] / res["kernel_ms"]
                    result["rows"].append(res)
                    print(json.dumps(res), flush=True)
                    save()
                for sid in range(batch):
                    om.allocator.free(sid)
        result["runners"][backend] = piecewise.summary() if piecewise is not None else None
        save()
        del om, piecewise
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


    def run_hf_all() -> None:
        shapes = hf_cache_shapes(model, device)
        result["hf_cache_per_token_per_layer"] = [{"key": k, "value": v} for k, v in shapes[:1]]
        for context in args.contexts:
            for batch in args.batches:
                gb = hf_cache_gb(shapes, batch, context)
                row: dict[str, Any] = {"variant": "hf_eager", "backend": "hf", "batch": batch, "context": context,
                                       "hf_cache_gb": round(gb, 1)}
                if gb > args.hf_max_cache_gb:
                    row["skipped"] = f"HF expanded K/V cache would need {gb:.0f} GiB (> {args.hf_max_cache_gb})"
                else:
                    t1 = time.perf_counter()
                    try:
                        row.update(run_hf(model, shapes, batch, context, max(5, args.steps // 2), 2, device))
                        row["tokens_per_s"] = batch / row["step_ms"] * 1e3
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    row["wall_s"] = round(time.perf_counter() - t1, 2)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()

    # HF runs right after the first backend, so a crash of a later backend cannot lose its numbers.
    jobs = backends_to_run(args, device)
    for k, (backend, why) in enumerate(jobs):
        if k == 1 and not args.skip_hf:
            run_hf_all()
        run_backend(backend, why)
    if len(jobs) <= 1 and not args.skip_hf:
        run_hf_all()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(f"wrote {path} in {result['total_s']}s", flush=True)
    print(table(result), flush=True)
    return 0


# ----------------------------------------------------------------------------- report
def _rows(result, variant, backend=None):
    return {(r["batch"], r["context"]): r for r in result["rows"]
            if r["variant"] == variant and (backend is None or r["backend"] == backend)}


def table(result: dict[str, Any]) -> str:
    hf = _rows(result, "hf_eager")
    backends = sorted({r["backend"] for r in result["rows"] if r["variant"] != "hf_eager"})
    lines = ["| context | batch | variant | step ms | tokens/s | vs HF eager | device ms | kernel ms | step / kernels |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["context"], r["batch"]) for r in result["rows"]})
    for context, batch in keys:
        h = hf.get((batch, context), {})
        entries = [("hf_eager", "hf", h)]
        for b in backends:
            for v in ("ours_eager", "ours_cg"):
                entries.append((f"{v} [{b}]", b, _rows(result, v, b).get((batch, context), {})))
        for name, _, r in entries:
            if not r:
                continue
            if "step_ms" not in r:
                why = r.get("skipped") or r.get("error", "")
                lines.append(f"| {context} | {batch} | {name} | — | — | — | — | — | {why[:60]} |")
                continue
            sp = f"{h['step_ms'] / r['step_ms']:.1f}x" if "step_ms" in h and name != "hf_eager" else ""
            km = f"{r['kernel_ms']:.3f}" if "kernel_ms" in r else ""
            dm = f"{r['device_ms']:.3f}" if "device_ms" in r else ""
            ratio = f"{r['latency_over_kernels']:.2f}" if "latency_over_kernels" in r else ""
            lines.append(f"| {context} | {batch} | {name} | {r['step_ms']:.3f} | {r['tokens_per_s']:.0f} | {sp} | "
                         f"{dm} | {km} | {ratio} |")
    return "\n".join(lines)


def render(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    contexts = sorted({r["context"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    series = sorted({(r["variant"], r["backend"]) for r in result["rows"]})
    for ax, context in zip(axes[0], contexts):
        for variant, backend in series:
            pts = sorted((r["batch"], r["step_ms"]) for r in result["rows"]
                         if r["variant"] == variant and r["backend"] == backend and r["context"] == context
                         and "step_ms" in r)
            if not pts:
                continue
            label = "HF eager" if variant == "hf_eager" else f"{variant} [{backend}]"
            style = "--" if variant == "hf_eager" else ("-" if variant == "ours_cg" else ":")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences, one token each)")
        ax.set_ylabel("decode step latency (ms)")
        ax.set_title(f"context {context}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(f"DeepSeek-V3-shaped {result['model']['num_hidden_layers']}-layer model, bf16, "
                 f"{env.get('gpu', 'cpu')}", fontsize=10)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    md = path.with_suffix(".md")
    m = result["model"]
    md.write_text(
        "# End-to-end decode step latency\n\n"
        f"Machine: {env.get('gpu', 'cpu')} ({env.get('sms', '?')} SMs), torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, transformers {env.get('transformers')}, triton {env.get('lib_triton')}, flashinfer "
        f"{env.get('lib_flashinfer')}.\n\n"
        f"Command: `{result['command']}` (total {result.get('total_s', '?')} s).\n\n"
        f"Model: DeepseekV3 config, {m['num_hidden_layers']} layers (first dense, then MoE "
        f"{m['n_routed_experts']} experts x {m['moe_intermediate_size']}, top-{m['num_experts_per_tok']}, 1 shared), "
        f"hidden {m['hidden_size']}, N {m['num_attention_heads']}, q_lora {m['q_lora_rank']}, R {m['kv_lora_rank']}, "
        f"Dr {m['qk_rope_head_dim']}, Dn {m['qk_nope_head_dim']}, Dv {m['v_head_dim']}, vocab {m['vocab_size']}; "
        f"{result.get('model_params', 0) / 1e9:.2f} B random parameters, {result['dtype']}.\n\n"
        "Step latency = wall clock of one decode step (all sequences add one token at the given context) "
        "including host metadata, prepare hooks, launches and the sampling sync; median over the timed steps. "
        "`device ms` = CUDA events around the model call (first launch to last kernel end, incl. launch gaps); "
        "`kernel ms` = sum of GPU kernel + memcpy times per step from torch.profiler (ours_cg only).\n\n"
        + table(result) + "\n\n"
        + "Notes:\n\n" + "\n".join(f"- {n}" for n in result.get("run_notes", []) + result.get("notes", []))
        + "\n\n"
        + f"![plot]({png.name})\n"
    )
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    sys.exit(main())
