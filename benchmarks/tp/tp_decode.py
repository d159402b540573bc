"""Tensor-parallel scaling: decode step latency, prefill throughput, all-reduce share, build time and
memory per rank at world sizes 1, 2, 4, 8 (the `shard` pass, NCCL all-reduce).

Models (`--model`): `v32_shape` (the V3 shape with DeepSeek-V3.2's lightning indexer per layer:
DeepSeek Sparse Attention, 64 index heads x 128, `--index-topk` 2048), `v3_shape` (default; a DeepSeek-V3-shaped `transformers` model with the real MLA
dims N 128, q_lora 1536, R 512, Dr 64, Dn 128, Dv 128, hidden 7168, a few layers with fewer/smaller
routed experts; the model of benchmarks/e2e/e2e_decode.py), or a published config: `v2_lite`
(DeepSeek-V2-Lite, 15.7 B), `glm_4_7_flash` (GLM-4.7-Flash, 29.9 B, N 20, Dn 192 != Dv 256),
`deepseek_v2` (DeepSeek-V2, 236 B: 4 or more H200s, 112 GiB of weights per rank at 4). Random bf16
weights with `model.init: hashed` (default): every rank builds a weightless skeleton and generates only its own slices, so no rank
ever holds the full model. With W ranks every rank holds N/W heads, 1/W of every MLP/expert, the
full latent cache, and runs one all-reduce per attention block and one per MLP/MoE block.

One decode step = every sequence of the batch adds one token at context length C, through
`ModelRunner.forward`: host metadata, the graph (piecewise runner: CUDA graphs on by default,
collectives captured inside them), the sampling sync (argmax of this rank's logits rows -> host; no
rank-0 broadcast). Median over steps; for several ranks the slower rank's median is reported.
Caches are filled with random latents (no prefill is timed there). `--prefill P`: one P-token
prompt prefilled from an empty cache (median of 3). `--agree K`: greedy tokens of 4 prompts x K new
tokens, compared with world size 1 in the table. `--profile C,B`: 3 profiled steps per rank; the
all-reduce share of the step is the NCCL kernels' device time (including any wait for the slower
rank) over all kernels' device time.

    python -m benchmarks.tp.tp_decode --out /tmp/tp            # on a 2-GPU host (nvidia-h200-x2)
    python -m benchmarks.tp.tp_decode --model glm_4_7_flash --world-sizes 1,2 --batches 1,8,64 --prefill 2048 \
        --agree 8 --profile 1024,64 --out /tmp/tp_glm
    python -m benchmarks.tp.tp_decode --render /tmp/tp/tp_decode.json   # markdown table + plot (CPU ok)
    python -m benchmarks.tp.tp_decode --render w1/tp_decode.json w2/tp_decode.json --out merged  # runs merged
    python -m benchmarks.tp.tp_decode --quick --device cpu --out /tmp/tpq  # CPU/gloo dry run of the plumbing
    python -m benchmarks.tp.tp_decode --model glm_4_7_flash --layout data --world-sizes 1,2,4 --batches 64 \
        --contexts 1024 --profile 1024,64 --out /tmp/dp_glm   # issue 47: data-parallel attention + EP experts

`--layout data` (issue 47, docs/parallel_layouts.md): attention data-parallel (every rank whole
attention on its own sequences and cache), routed experts expert-parallel, dense and shared-expert
MLPs replicated (`--dp-mlp tensor`: split, all-gather before / reduce-scatter after each). The
`batch` column stays the whole batch: each rank runs batch / world of its sequences (a batch that does
not divide is an error row), so tokens/s and the speed-up compare the same total batch at every world
size; prefill: every rank prefills its own prompt (tokens/s counts all ranks'). The collective share
then counts NCCL's all-to-all / all-gather / reduce-scatter kernels (the experts' dispatch).

Copy the JSON/md/png into docs/benchmarks/ (tp_decode.* for v3_shape, tp_scaling.* for published
configs) and quote the machine and command from the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from benchmarks.lib import (
    PUBLISHED,
    decode_runtime,
    deepseek_v32_shaped,
    deepseek_v3_shaped,
    extra_tokens,
    pyplot,
    time_decode_stream,
    time_prefill,
)

DEFAULT_BATCHES = (1, 8, 32, 64)
DEFAULT_CONTEXTS = (1024, 4096)
PROFILE_STEPS = 3  # steps run under torch.profiler with --profile
AGREE_PROMPTS = ([5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42], [7, 1, 250, 9, 9, 30, 31, 32, 33])


def hf_config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The HF config dict of `--model` (the V3 shape from the dimension arguments; --quick shrinks it)."""
    if args.model == "v32_shape":
        return deepseek_v32_shaped(args)
    if args.model == "v3_shape" or args.quick:
        return deepseek_v3_shaped(args)
    return dict(PUBLISHED[args.model])


def reserved_tokens(args: argparse.Namespace) -> int:
    """Tokens a sequence grows past its context: the isolated (and profiled) steps, or the queued
    stream (time_decode_stream reserves its steps + 3 warm-up steps + 8)."""
    return max(extra_tokens(args, PROFILE_STEPS), args.stream + 3 + 8)


def build_config(args: argparse.Namespace, device: str) -> dict[str, Any]:
    runtime = decode_runtime(args, reserved_tokens(args))
    if args.prefill:  # one prompt of `prefill` tokens in one step (its pages fit in the decode reservation)
        runtime["max_num_tokens"] = max(runtime["max_num_tokens"], args.prefill)
        runtime["max_seq_len"] = max(runtime["max_seq_len"], args.prefill + args.agree + 8)
    piecewise: dict[str, Any] = {"enabled": True, "on_cpu": args.quick, "cuda_graphs": not args.no_cuda_graphs}
    # Captured token counts: the decode batches (and the prefill length) only, not every power of two:
    # each bucket is one more CUDA graph per piece to capture at warm-up.
    batches = set(args.batches)
    if args.layout == "data":  # each rank runs its share of the batch
        batches |= {b // w for b in args.batches for w in args.world_sizes if b % w == 0}
    piecewise["buckets"] = sorted(batches | ({args.prefill} if args.prefill else set()))
    return {
        "model": {"hf_config": hf_config_of(args), "dtype": "bfloat16" if device == "cuda" else "float32",
                  "device": device, "seed": 0, "init": args.init},
        "runtime": runtime,
        "transforms": {"insert_cached_mla_attention": {"backend": args.backend}, "piecewise": piecewise},
    }


def _max_over_ranks(x: float, world: int, device: torch.device) -> float:
    """The largest `x` of all ranks (the slower rank decides a step's time)."""
    if world == 1:
        return x
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_rank(rank: int, args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    """One rank: build (shard pass on when world > 1), then time decode steps per (context, batch)."""
    from benchmarks.lib import optimize
    from benchmarks.lib import env_info
    from benchmarks.lib import StepSequence

    info = env_info()
    world = info.world_size
    device = f"cuda:{info.local_rank}" if device_type == "cuda" else "cpu"
    cfg = build_config(args, device_type)
    sets = [f"model.device={device}"]
    if world > 1:
        sets += ["transforms.shard.enabled=true", f"transforms.shard.all_reduce={args.all_reduce}"]
        if args.layout == "data":
            sets += ["transforms.shard.attention=data", "transforms.shard.experts=expert",
                     f"transforms.shard.mlp={args.dp_mlp}", f"transforms.shard.ep_collective={args.ep_collective}"]
    t0 = time.perf_counter()
    om = optimize(None, cfg, overrides=sets)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    om.warmup()  # Inductor compiles + CUDA graph captures of every bucket
    warmup_s = time.perf_counter() - t0
    if rank == 0:
        print(f"world {world}: build {build_s:.0f}s, warm-up {warmup_s:.0f}s", flush=True)
    dev = om.device
    runner = om.runner
    shard = next((r.summary for r in om.history if r.name == "shard" and r.enabled), "")
    backends = sorted({lay["backend"] for lay in om.report()["layers"]})
    heads = om.report()["layers"][0]["dims"]["num_heads"]
    # by storage, not by tensor: fused weights are views of one storage (counted by tensor, the published
    # GLM-4.7-Flash read 109 GiB on one GPU whose peak allocation was 60 GiB)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*om.gm.parameters(), *om.gm.buffers()] if t.device.type != "meta"}
    weight_gb = sum(storages.values()) / 2**30
    load = next((r.details for r in om.history if r.name == "load_weights"), {})
    agree = om.generate([list(p) for p in AGREE_PROMPTS], max_new_tokens=args.agree) if args.agree else None
    first_logits = first_token_logits(om) if args.agree else None
    prefill: dict[str, Any] = {}
    if args.prefill:
        ms = _max_over_ranks(time_prefill(om, args.prefill, reps=3)["step_ms"], world, dev)
        prompts = world if args.layout == "data" else 1  # data-parallel: every rank prefills its own prompt
        prefill = {"tokens": args.prefill, "ms": ms, "tokens_per_s": prompts * args.prefill / ms * 1e3}
        if rank == 0:
            print(json.dumps({"world_size": world, "prefill": prefill}), flush=True)
    rows = []
    extra = reserved_tokens(args)

    def step_paths() -> Counter:
        """How the piecewise runner has run steps so far (decode_graph, piecewise, eager)."""
        return Counter(runner.piecewise.stats) if runner.piecewise is not None else Counter()

    for context in args.contexts:
        for batch in args.batches:
            if args.layout == "data" and batch % world:
                rows.append({"world_size": world, "batch": batch, "context": context, "paths": {},
                             "error": f"batch {batch} does not divide over {world} data-parallel ranks"})
                continue
            local = batch // world if args.layout == "data" else batch  # this rank's sequences
            runner.allocator.ensure_many({sid: context + extra for sid in range(local)})
            g = torch.Generator(device=dev).manual_seed(batch * 7 + context)
            for c in runner.caches.caches.values():
                c.normal_(generator=g)
            tok, ts = [1] * local, []
            pos0 = context - args.warmup
            err, paths, profiled = None, {}, {}
            paths0 = step_paths()

            def step(i: int) -> None:
                nonlocal tok
                seqs = [StepSequence(s, [tok[s]], pos0 + i) for s in range(local)]
                _, logits = runner.forward(seqs, runner.allocator.pages_of)  # all decode: order = seqs
                tok = logits[0, :local].argmax(-1).tolist()  # the sampling sync

            try:
                for i in range(args.warmup + args.steps):
                    _sync(dev)
                    t1 = time.perf_counter()
                    step(i)
                    if i == args.warmup - 1:
                        paths0 = step_paths()
                    if i >= args.warmup:
                        ts.append((time.perf_counter() - t1) * 1e3)
                paths = dict(step_paths() - paths0)
                if args.profile == [context, batch]:
                    share = profile_steps(step, args.warmup + args.steps,
                                          Path(args.out) / f"profile_w{world}_r{rank}.txt")
                    profiled = {"profiled_" + k: _max_over_ranks(v, world, dev) for k, v in share.items()}
            except Exception as exc:  # noqa: BLE001 - recorded; every rank fails the same way
                err = f"{type(exc).__name__}: {exc}"[:400]
            for sid in range(local):
                runner.allocator.free(sid)
            stream: dict[str, float] = {}
            if not err and args.stream > 1:  # the engine's steady state: steps queued, tokens from the device
                try:
                    got = time_decode_stream(om, local, context, args.stream)
                    if got:
                        stream = {"stream_ms": _max_over_ranks(got["stream_ms"], world, dev)}
                except Exception as exc:  # noqa: BLE001 - recorded like the isolated steps' errors
                    err = f"stream: {type(exc).__name__}: {exc}"[:400]
            row: dict[str, Any] = {"world_size": world, "batch": batch, "batch_per_rank": local, "context": context,
                                   # how the timed steps ran: decode_graph (one CUDA graph), piecewise, eager
                                   "paths": paths}
            if err:
                row["error"] = err
            else:
                ts.sort()
                med = _max_over_ranks(statistics.median(ts), world, dev)  # the slower rank decides
                row.update({"step_ms": med, "p10_ms": ts[len(ts) // 10], "p90_ms": ts[(9 * len(ts)) // 10],
                            "steps": len(ts), "tokens_per_s": batch / med * 1e3, **profiled, **stream})
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    mem_gb = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {"world_size": world, "rows": rows, "build_s": build_s, "warmup_s": warmup_s, "shard": shard, "backends": backends,
            "heads_per_rank": heads, "all_reduce": runner.tp_all_reduce, "max_memory_gb": mem_gb, "weight_gb_per_rank": weight_gb,
            "cache_gb_per_rank": sum(c.numel() * c.element_size() for c in runner.caches.caches.values()) / 2**30,
            "weights_made": {k: load.get(k) for k in ("source", "bytes_read", "full_model_bytes")},
            "prefill": prefill, "agree_tokens": agree, "first_logits": first_logits}


def first_token_logits(om, top: int = 8) -> list[dict[str, Any]]:
    """Per agreement prompt, the logits of its first new token: the `top` largest (ids, values) and
    max |logit|. Greedy tokens of random-weight models often sit at near-ties, where any change of
    summation order (sharded GEMMs, all-reduce) may flip them; these let the table say how close."""
    out = []
    for prompt in AGREE_PROMPTS:
        row = om.runner.prefill_logits(list(prompt))[-1].float()
        vals, ids = row.topk(top)
        out.append({"ids": ids.tolist(), "values": vals.tolist(), "max_abs": float(row.abs().max())})
    return out


def agreement(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> str:
    """First-token agreement of world size w with world size 1 from `first_token_logits`: identical
    argmax count; the largest difference of a logit both runs rank in their top lists, relative to
    max |logit|; where the argmax differs, the 1-GPU gap between the two tokens (relative)."""
    same, err, gaps = 0, 0.0, []
    for a, b in zip(ref, got):
        same += a["ids"][0] == b["ids"][0]
        va, vb = dict(zip(a["ids"], a["values"])), dict(zip(b["ids"], b["values"]))
        err = max([err] + [abs(va[i] - vb[i]) / a["max_abs"] for i in va.keys() & vb.keys()])
        if a["ids"][0] != b["ids"][0] and b["ids"][0] in va:
            gaps.append(f"{(a['values'][0] - va[b['ids'][0]]) / a['max_abs']:.1e}")
        elif a["ids"][0] != b["ids"][0]:
            gaps.append(f">{(a['values'][0] - a['values'][-1]) / a['max_abs']:.1e}")
    return (f"first token {same}/{len(ref)} identical, top-logit error {err:.1e} of max |logit|"
            + (f", 1-GPU gap of the flipped tokens {', '.join(gaps)}" if gaps else ""))


def is_all_reduce_kernel(name: str) -> bool:
    """NCCL's kernels (under `--layout data` the experts' all-to-all / all-gather / reduce-scatter)
    and the symmetric-memory all-reduce kernels (autodeploy::tp_all_reduce); not Inductor's kernels
    named after the op whose input they compute."""
    low = name.lower()
    return "nccl" in low or ("all_reduce_kernel" in low and not low.startswith("triton_"))


def profile_steps(step: Any, first: int, path: Path) -> dict[str, float]:
    """Run PROFILE_STEPS more steps under torch.profiler; write the ops by device time and by host time
    to `path`; return the per-step kernel time and the all-reduce (NCCL kernel) time and share."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for i in range(first, first + PROFILE_STEPS):
            step(i)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    avg = prof.key_averages()
    path.write_text(f"{PROFILE_STEPS} decode steps, torch threads {torch.get_num_threads()}\n"
                    + avg.table(sort_by=key, row_limit=25) + "\nby host time\n"
                    + avg.table(sort_by="self_cpu_time_total", row_limit=25))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1e3 / PROFILE_STEPS  # us -> ms per step
    nccl = sum(e.device_time for e in kernels if is_all_reduce_kernel(e.name)) / 1e3 / PROFILE_STEPS
    return {"kernel_ms": total, "allreduce_ms": nccl, "allreduce_share": nccl / total if total else 0.0}


def environment(device_type: str) -> dict[str, Any]:
    from benchmarks.lib import library_versions

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "host": platform.node()}
    env.update({f"lib_{k}": v for k, v in library_versions().items()})
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update({"gpu": p.name, "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    return env


def model_line(data: dict[str, Any]) -> str:
    m = data["model"]
    name = data.get("model_name", "v3_shape")
    what = {"v3_shape": "DeepSeek-V3-shaped", "v32_shape": f"DeepSeek-V3.2-shaped (sparse attention, index_topk "
            f"{m.get('index_topk')})"}.get(name, f"published {name} config")
    return (f"Model: {what}, {m['num_hidden_layers']} layers, N {m['num_attention_heads']}, R {m['kv_lora_rank']}, "
            f"hidden {m['hidden_size']}, {m.get('n_routed_experts', 0)} experts x {m['moe_intermediate_size']} "
            f"top-{m.get('num_experts_per_tok', 0)}, dtype {data['dtype']}, weights `model.init: "
            f"{data.get('init', 'transformers')}`.")


def merge(paths: list[Path]) -> dict[str, Any]:
    """One result from runs of the same model at different world sizes (e.g. one device call each):
    rows and per-world entries of later files replace those of earlier ones for the same world size."""
    data = json.loads(paths[0].read_text())
    for p in paths[1:]:
        more = json.loads(p.read_text())
        if (more.get("model_name"), more["model"]) != (data.get("model_name"), data["model"]):
            raise SystemExit(f"{p}: another model than {paths[0]}; merge runs of one model only")
        sizes = {w["world_size"] for w in more["worlds"]}
        data["rows"] = [r for r in data["rows"] if r["world_size"] not in sizes] + more["rows"]
        data["worlds"] = sorted([w for w in data["worlds"] if w["world_size"] not in sizes] + more["worlds"],
                                key=lambda w: w["world_size"])
        data["command"] = f"{data['command']}; {more['command']}"
    return data


def render(path: Path, data: Optional[dict[str, Any]] = None) -> None:
    """Markdown table + plot next to `path` (from `data` if given, else the JSON at `path`)."""
    data = data if data is not None else json.loads(path.read_text())
    rows = data["rows"]
    by = {(r["world_size"], r["context"], r["batch"]): r for r in rows}
    worlds = sorted({r["world_size"] for r in rows})
    top = max(worlds)
    queued = any("stream_ms" in r for r in rows)
    head = (["context", "batch"] + [f"{w} GPU ms" for w in worlds] + ([f"queued {w} GPU ms" for w in worlds] if queued else [])
            + [f"speed-up {w}" for w in worlds if w > 1] + ([f"queued speed-up {w}" for w in worlds if w > 1] if queued else [])
            + [f"tokens/s ({top} GPU{', queued' if queued else ''})", "all-reduce ms (share)", "timed steps ran as"])
    title = (f"Data-parallel attention + expert-parallel MoE scaling (MLPs: {data.get('dp_mlp') or 'replicate'}, "
             f"experts by {data.get('ep_collective') or 'auto'})"
             if data.get("layout") == "data" else "Tensor-parallel scaling")
    lines = [f"# {title} ({data['environment'].get('gpu', 'cpu')})", "",
             f"Command: `{data['command']}`", "", model_line(data),
             "Decode step = host metadata + graph + argmax sync; median ms (several ranks: the slower rank). "
             + ("Queued = steps queued as the engine queues them (overlap on, each step's tokens taken on the "
                "device from the last step's sampled rows): GPU time per step in steady state, the inter-token "
                "time a serving batch sees. " if queued else "")
             + "Speed-up = 1 GPU / each world size. All-reduce = all-reduce kernel time per step (NCCL or one-shot), "
             "incl. waiting on the slower rank (profiled rows only).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context in sorted({r["context"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            cells, ms = [], {}
            for w in worlds:
                r = by.get((w, context, batch), {})
                if "step_ms" in r:
                    ms[w] = r["step_ms"]
                    cells.append(f"{r['step_ms']:.3f}")
                else:
                    cells.append(r.get("error", "-")[:40])
            sps = [f"{ms[1] / ms[w]:.2f}x" if 1 in ms and w in ms else "-" for w in worlds if w > 1]
            if queued:
                qs = {w: by[(w, context, batch)]["stream_ms"] for w in worlds
                      if "stream_ms" in by.get((w, context, batch), {})}
                cells += [f"{qs[w]:.3f}" if w in qs else "-" for w in worlds]
                sps += [f"{qs[1] / qs[w]:.2f}x" if 1 in qs and w in qs else "-" for w in worlds if w > 1]
                ms = qs
            tps = f"{batch / ms[top] * 1e3:.0f}" if top in ms else "-"
            ar = "; ".join(f"{w}: {by[(w, context, batch)]['profiled_allreduce_ms']:.2f} "
                           f"({by[(w, context, batch)]['profiled_allreduce_share']:.0%})"
                           for w in worlds if "profiled_allreduce_ms" in by.get((w, context, batch), {}) and w > 1)
            paths = "; ".join(f"{w}: " + ", ".join(f"{k} {v}" for k, v in sorted(by[(w, context, batch)]["paths"].items()))
                              for w in worlds if by.get((w, context, batch), {}).get("paths"))
            lines.append("| " + " | ".join([str(context), str(batch), *cells, *sps, tps, ar or "-", paths or "-"]) + " |")
    lines.append("")
    worlds_info = {w["world_size"]: w for w in data["worlds"]}
    if any(w.get("prefill") for w in data["worlds"]):
        base = worlds_info.get(1, {}).get("prefill", {}).get("ms")
        lines += ["| world size | prefill tokens | ms | tokens/s | speed-up |", "|---|---|---|---|---|"]
        for w, info in sorted(worlds_info.items()):
            pf = info.get("prefill") or {}
            if pf:
                sp = f"{base / pf['ms']:.2f}x" if base else "-"
                lines.append(f"| {w} | {pf['tokens']} | {pf['ms']:.2f} | {pf['tokens_per_s']:.0f} | {sp} |")
        lines.append("")
    ref = worlds_info.get(1, {}).get("agree_tokens")
    for w, info in sorted(worlds_info.items()):
        mem = "-" if info["max_memory_gb"] is None else f"{info['max_memory_gb']:.1f} GiB"
        made = info.get("weights_made") or {}
        src = (f", weights made by slices: {made['bytes_read'] / 2**30:.1f} of {made['full_model_bytes'] / 2**30:.1f} GiB "
               f"({made['source']})" if made.get("bytes_read") else "")
        agree = ""
        if ref and info.get("agree_tokens") and w > 1:
            same = sum(a == b for a, b in zip(ref, info["agree_tokens"]))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(ref, info["agree_tokens"])]
            agree = (f"; greedy tokens vs 1 GPU: {same}/{len(ref)} prompts identical"
                     + (f" (first difference at new token {[f for f in first if f is not None]})" if same < len(ref) else ""))
            ref_logits = worlds_info.get(1, {}).get("first_logits")
            if ref_logits and info.get("first_logits"):
                agree += f" ({agreement(ref_logits, info['first_logits'])})"
        ar_line = f", all-reduce {info['all_reduce']}" if info.get("all_reduce") else ""
        lines.append(f"- {w} rank(s): backends {info['backends']}, heads/rank {info['heads_per_rank']}{ar_line}, "
                     f"build {info['build_s']:.1f}s + warm-up {info.get('warmup_s', 0):.0f}s, weights {info.get('weight_gb_per_rank', 0):.1f} GiB/rank, "
                     f"cache {info.get('cache_gb_per_rank', 0):.1f} GiB/rank, peak memory {mem}{src}{agree}; "
                     f"{info['shard'] or 'no sharding'}")
    if data.get("notes"):  # added by hand after the run: what was measured around it
        lines += ["", "Notes:", *[f"- {n}" for n in data["notes"]]]
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for w in worlds:
        for context in sorted({r["context"] for r in rows}):
            for key, style, what in (("step_ms", "-", ""), ("stream_ms", "--", ", queued")):
                pts = sorted((r["batch"], r[key]) for r in rows
                             if r["world_size"] == w and r["context"] == context and key in r)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{w} GPU, context {context}{what}")
    ax.set_xlabel("batch (sequences per decode step)")
    ax.set_ylabel("decode step latency (ms)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"{data.get('model_name', 'v3_shape')} decode: tensor parallel " + " vs ".join(f"{w}" for w in worlds) + " GPUs")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/tp_decode")
    ap.add_argument("--render", nargs="+", help="render table + plot from this JSON (several: runs of one model at "
                    "different world sizes, merged into the --out directory) and exit")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_BATCHES))
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_CONTEXTS))
    ap.add_argument("--model", default="v3_shape", choices=["v3_shape", "v32_shape", *PUBLISHED])
    ap.add_argument("--index-topk", type=int, default=2048, help="v32_shape: the indexer's top-k")
    ap.add_argument("--init", default="hashed", choices=["hashed", "transformers"],
                    help="random weights: hashed = every rank generates only its slices")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prefill of this many tokens per world size")
    ap.add_argument("--agree", type=int, default=0, help="greedy tokens of 4 prompts x this many, compared with 1 GPU")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--all-reduce", default="nccl", choices=["nccl", "one_shot"],
                    help="transforms.shard.all_reduce for world sizes > 1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--q-lora", type=int, default=1536)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--dn", type=int, default=128)
    ap.add_argument("--dr", type=int, default=64)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stream", type=int, default=12, help="also time this many decode steps queued as the engine "
                    "queues them (e2e_roofline.time_decode_stream: overlap on, tokens from the device); 0: off")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="piecewise pieces run eagerly")
    ap.add_argument("--profile", type=lambda s: [int(x) for x in s.split(",")], metavar="CONTEXT,BATCH",
                    help="also profile 3 steps of this (context, batch) in every rank -> <out>/profile_w*_r*.txt")
    ap.add_argument("--quick", action="store_true", help="tiny dims for a CPU dry run (gloo)")
    ap.add_argument("--layout", default="tensor", choices=["tensor", "data"],
                    help="tensor: heads, MLPs and experts split (the shard pass's default); data: attention "
                         "data-parallel, experts expert-parallel, MLPs as --dp-mlp says (issue 47; module docstring)")
    ap.add_argument("--ep-collective", default="auto", choices=["auto", "all_to_all", "allgather_reducescatter"],
                    help="--layout data: how the routed pairs reach their experts' ranks (transforms.shard.ep_collective)")
    ap.add_argument("--dp-mlp", default="replicate", choices=["replicate", "tensor"],
                    help="--layout data: dense and shared-expert MLPs whole on every rank, or split with an "
                         "all-gather of every rank's tokens before and a reduce-scatter after each")
    args = ap.parse_args(argv)
    if args.render:
        if len(args.render) == 1:
            render(Path(args.render[0]))
        else:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            merged = merge([Path(p) for p in args.render])
            out = Path(args.out) / Path(args.render[0]).name
            out.write_text(json.dumps(merged, indent=1, default=str))
            render(out, merged)
        return 0
    if args.quick:
        args.hidden, args.heads, args.intermediate, args.moe_intermediate, args.vocab = 128, 4, 128, 32, 256
        args.q_lora, args.kv_lora, args.dn, args.dr, args.dv = 64, 64, 16, 16, 16
        args.experts, args.layers, args.page_size, args.steps, args.warmup = 4, 2, 16, 3, 1
        args.batches, args.contexts = ([2, 4] if args.layout == "data" else [1, 4]), [32]
        args.index_topk, args.index_heads, args.index_dim = 8, 4, 16

    from benchmarks.lib import spawn

    device_type = args.device
    if device_type == "cuda" and torch.cuda.device_count() < max(args.world_sizes):
        print(f"need {max(args.world_sizes)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(device_type),
        "model_name": args.model,
        "layout": args.layout,
        "dp_mlp": args.dp_mlp if args.layout == "data" else None,
        "ep_collective": args.ep_collective if args.layout == "data" else None,
        "init": args.init,
        "model": hf_config_of(args),
        "dtype": "bfloat16" if device_type == "cuda" else "float32",
        "rows": [],
        "worlds": [],
    }
    path = out_dir / "tp_decode.json"
    backend = "nccl" if device_type == "cuda" else "gloo"
    for world in args.world_sizes:
        t0 = time.perf_counter()
        res = spawn(bench_rank, world, args, device_type, backend=backend)
        print(f"world {world}: {time.perf_counter() - t0:.0f}s, {res['shard'] or 'no sharding'}", flush=True)
        result["rows"] += res.pop("rows")
        result["worlds"].append(res)
        path.write_text(json.dumps(result, indent=1, default=str))
    render(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
