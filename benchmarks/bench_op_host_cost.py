"""Eager host cost of one cached MLA op call: old code (commit 0f20270) vs new code (working tree).

What. The host (CPU-side) time of one eager call of each backend's cached op, exactly as a model
step makes it, in the code before and after the backend-session refactor:

- old (0f20270): backends keep module-global state (`flashinfer_mla._STATE`); per model
  `be.setup([dims], dtype, seq_info)`, per step `be.prepare(seq_info)`, and the graph calls
  `be.cached_op.default(*inputs, *[seq_info.get(m) for m in be.metadata], cache, scale)` directly
  (the overload the cache-insertion pass puts in the graph, in both versions);
- new (working tree): `session = be.setup(SessionSpec(...))` per model, per step
  `session.prepare(seq_info, step_descriptor(seq_info))`, and the op runs inside
  `with using_sessions({name: session}):` (entered once per step around all op calls, as
  ModelRunner.forward does); every op goes through `op_contract.define_cached_op`, which repacks
  its arguments into `MLAInputs` + a metadata dict, and reads its session from a ContextVar.

Why. The refactor must not make the eager per-call host cost grow: on decode the host path of
every layer's op is on the critical path whenever a step is not a CUDA-graph replay.

How. Each code root runs in its own subprocess with PYTHONPATH=<root>:$PYTHONPATH, so the two
packages never mix (the child checks where `autodeploy_mla` came from); the parent alternates the
roots over `--rounds` (ABBA order, against drift), pools the samples and merges the results. For
every backend the device accepts (torch always; triton when its check() accepts, never on CPU,
where only the interpreter would run it; flashinfer_mla / flashinfer_trtllm_mla when installed and
accepted) and each step shape, a child builds the step once (SequenceInfo + PageAllocator, page
size 64, DeepSeek TP-8 dims N=16 Dn=128 Dr=64 Dv=128 R=512, bf16 on CUDA / fp32 on CPU) and
runs steps on it, each: [CUDA: synchronize, untimed, as the engine does to read sampled tokens],
`prepare` (timed: FlashInfer plans here; the new code's step descriptor is built inside the timed
region, as the runner builds one per step), [new: enter `using_sessions`, timed], `--calls-per-step`
op calls (each timed alone with perf_counter_ns, no synchronize inside), [new: leave the context,
timed]. Everything runs under `torch.inference_mode()` like ModelRunner. Host time is wall-clock
time of the Python call; on CUDA the GPU runs behind, so the number is the launch path. On CPU the
op's math runs inside the call, so the CPU numbers are compute plus overhead (torch backend only).
Reported: median, p10, p90 of per-call microseconds (>= 200 calls after >= 20 warm-up calls),
prepare per step, and context enter+leave per step. Shapes: the four model steps above plus
`floor_pad1` (no sequence, one padded token: every op returns right after its checks and cache
write), the per-call floor that isolates the call path (dispatcher, argument repacking, session
lookup) from the attention math; on a CPU, where the math runs inside the call, it is the number
that shows the call-path overhead.

The baseline root is the old package extracted next to the repo (git-ignored):

    mkdir -p .baseline_0f20270 && git archive 0f20270 autodeploy_mla model_configs | tar -x -C .baseline_0f20270

    python benchmarks/bench_op_host_cost.py --device cpu --out /tmp/op_host_cost
    python benchmarks/bench_op_host_cost.py --root .baseline_0f20270 --device cpu   # one root only

On a GPU machine (FlashInfer from the wheels in .whl/, as for the other benchmarks):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a \
        python3 benchmarks/bench_op_host_cost.py --out $OUT/op_host_cost

Writes op_host_cost.{json,md,png} into --out (the plot needs matplotlib) and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / ".baseline_0f20270"  # `git archive 0f20270 autodeploy_mla model_configs`
DEFAULT_BACKENDS = ("torch", "triton", "flashinfer_mla", "flashinfer_trtllm_mla")
DIMS = {"num_heads": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512}
PAGE_SIZE = 64


@dataclass(frozen=True)
class Shape:
    """One step: (new tokens, cached tokens) per sequence, prefill sequences first; `pad_to` pads it."""

    name: str
    label: str
    seqs: tuple[tuple[int, int], ...]
    pad_to: int | None = None


SHAPES = {s.name: s for s in (
    Shape("decode_b32_kv1024", "decode 32 x kv 1024", ((1, 1023),) * 32),
    Shape("decode_b1_kv512", "decode 1 x kv 512", ((1, 511),)),
    Shape("prefill_128", "prefill 1 x 128 new", ((128, 0),)),
    Shape("mixed_4d_p64", "mixed 4 decode (kv 1024) + prefill 64", ((64, 0),) + ((1, 1023),) * 4),
    # Speculative-decoding verification: 3 draft tokens + 1 per sequence on a cached history.
    Shape("spec_32x4_kv1024", "multi-token decode 32 x 4 new (kv 1024)", ((4, 1020),) * 32),
    # No sequence, one padded token: every op returns right after its checks and the cache write, so
    # this is the per-call floor (dispatcher, argument packing, session lookup) without the math.
    Shape("floor_pad1", "floor: 1 padded token, no sequence", (), pad_to=1),
)}


# ============================================================ child: one code root, in-process
def quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    def at(q: float) -> float:
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    return {"median": statistics.median(s), "p10": at(0.10), "p90": at(0.90), "n": len(s)}


@dataclass
class Step:
    """A prepared step of one backend: what a model step does around its cached-op calls."""

    op: Any  # the cached op's default overload, the graph node's target
    args: tuple  # (*inputs, *metadata, cache, scale): the graph's call_function arguments
    prepare: Callable[[], None]  # per-step host hook (FlashInfer: plan)
    context: Callable[[], Any] | None  # new code: a fresh `using_sessions(...)`; old code: None


class OldApi:
    """0f20270: stateless-looking descriptors over module-global state."""

    name = "old"

    def __init__(self) -> None:
        from autodeploy_mla.custom_ops.attention import registry as reg

        self.reg = reg

    def check(self, be, dims, dtype, device, page_size):
        return be.check(dims, dtype, self.reg.DeviceInfo.of(device), self.reg.library_versions(), page_size)

    def step(self, be, dims, dtype, info, args) -> Step:
        be.setup([dims], dtype, info)
        return Step(be.cached_op.default, args, lambda: be.prepare(info), None)


class NewApi:
    """Working tree: per-model sessions published through a ContextVar for the step."""

    name = "new"

    def __init__(self) -> None:
        from autodeploy_mla.custom_ops.attention import registry as reg
        from autodeploy_mla.custom_ops.attention.step_context import using_sessions

        try:  # the runner's own step description (it moved here from testing.scenarios)
            from autodeploy_mla.runtime.model_runner import step_descriptor
        except ImportError:
            from autodeploy_mla.testing.scenarios import step_descriptor

        self.reg, self.using_sessions, self.step_descriptor = reg, using_sessions, step_descriptor
        self.via = "op"

    def check(self, be, dims, dtype, device, page_size):
        return be.check(dims, dtype, self.reg.Target.detect(device, page_size))

    def step(self, be, dims, dtype, info, args, policy: Any = None) -> Step:
        import torch

        target = self.reg.Target.detect(info.device, info.page_size)
        spec = self.reg.SessionSpec((dims,), dtype, torch.device(info.device), target, info.max_batch_size,
                                    info.max_num_tokens, info.max_pages_per_seq)
        session = be.setup(spec) if policy is None else be.setup(spec, policy)
        sessions = {be.name: session}  # the runner's dict: built once per model
        describe = self.step_descriptor

        def prepare() -> None:
            session.prepare(info, describe(info))

        # --via direct: what the piecewise runner calls for an eager attention piece (the backend's
        # direct_call, no dispatcher), where the backend has one; else the op, as a graph calls it
        op = getattr(be, "direct_call", None) if self.via == "direct" else None
        return Step(op or be.cached_op.default, args, prepare, lambda: self.using_sessions(sessions))


def load_api(root: Path):
    import autodeploy_mla
    import autodeploy_mla.custom_ops

    where = Path(autodeploy_mla.__file__).resolve()
    if root.resolve() not in where.parents:
        raise SystemExit(f"autodeploy_mla was imported from {where}, not from --root {root}")
    from autodeploy_mla.custom_ops.attention import registry as reg

    return NewApi() if hasattr(reg, "SessionSpec") else OldApi()


def build_step_data(be, shape: Shape, dtype, device):
    """SequenceInfo, cache and inputs of one step, and the op's argument tuple."""
    import torch

    from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
    from autodeploy_mla.runtime.page_allocator import PageAllocator
    from autodeploy_mla.runtime.sequence_info import SequenceInfo, StepSequence

    dims = MLADims(**DIMS)
    lens = [new + cached for new, cached in shape.seqs]
    tokens = max(sum(new for new, _ in shape.seqs), shape.pad_to or 0)
    info = SequenceInfo(max(1, len(lens)), tokens, max(lens, default=1), PAGE_SIZE, device)
    num_pages = max(2, 1 + sum(-(-n // PAGE_SIZE) for n in lens))  # + the scratch page
    alloc = PageAllocator(num_pages, PAGE_SIZE, info.max_pages_per_seq)
    alloc.ensure_many(dict(enumerate(lens)))
    info.prepare_step([StepSequence(i, [0] * new, cached) for i, (new, cached) in enumerate(shape.seqs)],
                      alloc.pages_of, pad_to=shape.pad_to)
    gen = torch.Generator().manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    n, dn, dr, dv, r = (DIMS[k] for k in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "kv_lora_rank"))
    inputs = (rand(1, tokens, n, dn), rand(1, tokens, n, dr), rand(1, tokens, r), rand(1, tokens, 1, dr),
              rand(n * (dn + dv), r) * r**-0.5)
    cache = rand(num_pages, PAGE_SIZE, r + dr)
    scale = float((dn + dr) ** -0.5)
    args = (*inputs, *(info.get(m) for m in be.metadata), cache, scale)
    return dims, info, args


def time_steps(step: Step, n_steps: int, calls_per_step: int, sync: Callable[[], None]) -> dict[str, list[float]]:
    """Run `n_steps` steps on the prepared step; per-call, per-prepare and per-context microseconds."""
    now = time.perf_counter_ns
    op, args = step.op, step.args
    calls, prepares, contexts = [], [], []
    for _ in range(n_steps):
        sync()  # untimed: the engine synchronises each step to read the sampled tokens
        t0 = now()
        step.prepare()
        prepares.append((now() - t0) / 1e3)
        cm, ctx_ns = None, 0
        if step.context is not None:  # `with using_sessions(...):` around the step, as the runner does
            t0 = now()
            cm = step.context()
            cm.__enter__()
            ctx_ns = now() - t0
        try:
            for _ in range(calls_per_step):
                t0 = now()
                op(*args)
                calls.append((now() - t0) / 1e3)
        finally:
            if cm is not None:
                t0 = now()
                cm.__exit__(None, None, None)
                contexts.append((ctx_ns + now() - t0) / 1e3)
    return {"call": calls, "prepare": prepares, "context": contexts}


def measure_case(api, be, shape: Shape, dtype, device: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dims, info, op_args = build_step_data(be, shape, dtype, device)
    step = api.step(be, dims, dtype, info, op_args)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cps = args.calls_per_step
    time_steps(step, -(-args.warmup // cps), cps, sync)  # warm-up: JIT, autotune, allocator
    sync()
    gc.collect()
    samples = time_steps(step, -(-args.calls // cps), cps, sync)
    sync()
    return samples


def child_main(args: argparse.Namespace) -> None:
    import torch

    root = Path(args.root)
    api = load_api(root)
    api.via = args.via
    from autodeploy_mla.custom_ops.attention.registry import all_backends
    from autodeploy_mla.custom_ops.attention.mla_dims import MLADims

    device = args.device
    dtype = getattr(torch, args.dtype)
    if args.pin_cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.pin_cpu})  # one core for every root and round: less scheduling noise
    if device == "cpu" and args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    registry = all_backends()
    out: dict[str, Any] = {"api": api.name, "root": str(root), "machine": machine_info(device), "cases": [],
                           "skipped": []}
    for name in args.backends:
        be = registry.get(name)
        if be is None:
            out["skipped"].append({"backend": name, "reason": "not registered in this code"})
            continue
        if name == "triton" and device == "cpu":
            out["skipped"].append({"backend": name, "reason": "CPU: only the Triton interpreter (too slow)"})
            continue
        res = api.check(be, MLADims(**DIMS), dtype, device, PAGE_SIZE)
        if not res.ok:
            out["skipped"].append({"backend": name, "reason": res.reason})
            continue
        for sname in args.shapes:
            shape = SHAPES[sname]
            print(f"[{api.name}] {name} {sname} ...", file=sys.stderr, flush=True)
            try:
                with torch.inference_mode():
                    samples = measure_case(api, be, shape, dtype, device, args)
            except Exception as e:  # noqa: BLE001  (one failing backend must not hide the others)
                out["cases"].append({"backend": name, "shape": sname, "error": f"{type(e).__name__}: {e}"})
                continue
            out["cases"].append({"backend": name, "shape": sname, "samples": samples})
    Path(args.result_file).write_text(json.dumps(out))


# ============================================================ parent: orchestrate roots, report
def machine_info(device: str) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    info = {"torch": version("torch"), "triton": version("triton"), "flashinfer": version("flashinfer-python"),
            "python": platform.python_version(), "cpu": cpu_name(), "host": platform.node()}
    if device.startswith("cuda"):
        import torch

        info["device"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = f"CPU ({info['cpu']}, {os.cpu_count()} cores)"
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_root(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one code root in a fresh interpreter whose PYTHONPATH starts with `root`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--root", str(root),
               "--device", args.device, "--dtype", args.dtype, "--backends", *args.backends,
               "--shapes", *args.shapes, "--calls", str(args.calls), "--warmup", str(args.warmup),
               "--calls-per-step", str(args.calls_per_step), "--cpu-threads", str(args.cpu_threads),
               "--pin-cpu", str(args.pin_cpu), "--result-file", str(result),
               "--via", args.new_via if root == Path(args.new_root).resolve() else "op"]
        # cwd outside the repo: nothing but PYTHONPATH can provide `autodeploy_mla`.
        proc = subprocess.run(cmd, env=env, cwd=tmp, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"measuring {root} failed (exit {proc.returncode})")
        return json.loads(result.read_text())


def run_rounds(roots: dict[str, Path], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """label -> one result per round; root order alternates (A B, B A, ...) against drift. With
    --out, every finished round is saved at once (op_host_cost_rounds.json), so a run cut short by a
    time limit keeps what it measured."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in roots}
    labels = list(roots)
    for k in range(args.rounds):
        for label in (labels if k % 2 == 0 else labels[::-1]):
            print(f"--- round {k + 1}/{args.rounds}: {label} code ({roots[label]})", file=sys.stderr, flush=True)
            runs[label].append(run_root(roots[label], args))
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "op_host_cost_rounds.json").write_text(json.dumps(runs))
    return runs


def merge(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(backend, shape) -> pooled stats over rounds, per-round call medians, or the error."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        for case in run["cases"]:
            key = (case["backend"], case["shape"])
            entry = pooled.setdefault(key, {"call": [], "prepare": [], "context": [], "round_medians": []})
            if "error" in case:
                entry["error"] = case["error"]
                continue
            for k in ("call", "prepare", "context"):
                entry[k] += case["samples"][k]
            entry["round_medians"].append(statistics.median(case["samples"]["call"]))
    out = {}
    for key, e in pooled.items():
        if not e["call"]:
            out[key] = {"error": e.get("error", "no samples")}
            continue
        out[key] = {k: quantiles(e[k]) if e[k] else None for k in ("call", "prepare", "context")}
        out[key]["round_medians"] = e["round_medians"]
        if "error" in e:
            out[key]["error"] = e["error"]
    return out


def build_rows(results: dict[str, dict], labels: list[str]) -> list[dict[str, Any]]:
    keys = []
    for label in labels:
        keys += [k for k in results[label] if k not in keys]
    rows = []
    for backend, shape in keys:
        row: dict[str, Any] = {"backend": backend, "shape": shape}
        for label in labels:
            row[label] = results[label].get((backend, shape), {"error": "not measured"})
        if len(labels) == 2 and all("call" in row[lb] for lb in labels):
            # Rounds differ far more than the versions do (a fresh process lands on other caches,
            # clocks and neighbours), so compare per-round medians: their median, and the best round.
            a, b = (statistics.median(row[lb]["round_medians"]) for lb in labels)
            row["ratio"], row["delta_us"] = b / a, b - a
            a, b = (min(row[lb]["round_medians"]) for lb in labels)
            row["best_ratio"], row["best_delta_us"] = b / a, b - a
        rows.append(row)
    return rows


def fmt(stats: dict[str, float] | None, spread: bool = False) -> str:
    if not stats:
        return "-"
    if spread:
        return f"{stats['median']:.1f} [{stats['p10']:.1f}-{stats['p90']:.1f}]"
    return f"{stats['median']:.1f}"


def table(rows: list[dict[str, Any]], labels: list[str]) -> list[str]:
    head = ["backend", "shape"] + [f"{lb} µs/call: median of rounds (pooled p10-p90)" for lb in labels]
    if len(labels) == 2:
        head += [f"{labels[1]}/{labels[0]}", f"{labels[1]}-{labels[0]} µs",
                 f"best round {labels[0]} / {labels[1]} µs", f"best-round {labels[1]}/{labels[0]}"]
    ctx_labels = [lb for lb in labels if any(r[lb].get("context") for r in rows)]  # new code only
    head += [f"{lb} prepare µs/step" for lb in labels] + [f"{lb} context µs/step" for lb in ctx_labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [r["backend"], SHAPES[r["shape"]].label]
        cells += [r[lb].get("error", "")[:60] if "call" not in r[lb] else
                  f"{statistics.median(r[lb]['round_medians']):.1f} [{r[lb]['call']['p10']:.1f}-{r[lb]['call']['p90']:.1f}]"
                  for lb in labels]
        if len(labels) == 2:
            if "ratio" in r:
                best = " / ".join(f"{min(r[lb]['round_medians']):.1f}" for lb in labels)
                cells += [f"{r['ratio']:.3f}", f"{r['delta_us']:+.1f}", best, f"{r['best_ratio']:.3f}"]
            else:
                cells += ["-"] * 4
        cells += [fmt(r[lb].get("prepare")) for lb in labels]
        cells += [fmt(r[lb].get("context")) for lb in ctx_labels]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(path: Path, rows, labels, meta, runs) -> list[str]:
    m = meta["machine"]
    lines = [
        "# Eager host cost of one cached MLA op call: " + " vs ".join(
            f"{lb} (`{Path(meta['roots'][lb]).name}`)" for lb in labels), "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        (f"Device: {m['device']}; CPU: {m['cpu']}; torch {m['torch']}, triton {m['triton']}, "
         f"flashinfer {m['flashinfer']}, Python {m['python']}  "),
        "Roots: " + ", ".join(f"{lb} = `{meta['roots'][lb]}`" for lb in labels) + f"; working tree {meta['git']}; "
        f"new root called via {meta.get('new_via', 'op')}  ",
        f"dtype {meta['dtype']}, dims N={DIMS['num_heads']} Dn={DIMS['qk_nope_head_dim']} "
        f"Dr={DIMS['qk_rope_head_dim']} Dv={DIMS['v_head_dim']} R={DIMS['kv_lora_rank']}, page size {PAGE_SIZE}; "
        f"{meta['calls']} timed calls after {meta['warmup']} warm-up calls, {meta['calls_per_step']} calls per "
        f"step, {meta['rounds']} round(s) per root (ABBA order), every process pinned to CPU "
        f"{meta.get('pin_cpu', -1)} (-1: none). Versions are compared on per-round medians: a fresh process lands on "
        "other caches, clocks and neighbours, so rounds of the same code differ more than the versions do"
        + (f", torch CPU threads {meta['cpu_threads'] or 'default'}" if meta["cpu_threads"] is not None else "")
        + ".", "",
        ("Per call: wall-clock time of `be.cached_op.default(*args)` alone (no synchronize inside; on CUDA the device runs "
         "behind). Prepare: `be.prepare(info)` (old) or `session.prepare(info, step_descriptor(info))` (new), "
         "once per step. Context: creating, entering and leaving `using_sessions` once per step (new only)."), "",
        *table(rows, labels), "",
    ]
    if len(labels) == 2:
        lines += ["Per-round medians of µs/call (spread between rounds = run-to-run noise):", "",
                  "| backend | shape | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
        for r in rows:
            cells = [" ".join(f"{x:.1f}" for x in r[lb].get("round_medians", [])) or "-" for lb in labels]
            lines.append(f"| {r['backend']} | {SHAPES[r['shape']].label} | " + " | ".join(cells) + " |")
        lines.append("")
    skipped = {(s["backend"], s["reason"]) for label in labels for run in runs[label] for s in run["skipped"]}
    if skipped:
        lines += ["Skipped backends:", ""] + [f"- {b}: {why}" for b, why in sorted(skipped)] + [""]
    path.write_text("\n".join(lines))
    return lines


def write_plot(path: Path, rows, labels) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    rows = [r for r in rows if all("call" in r[lb] for lb in labels)]
    if not rows:
        return
    names = [f"{r['backend']}\n{r['shape']}" for r in rows]
    x = list(range(len(rows)))
    width = 0.8 / len(labels)
    ncols = 2 if len(labels) == 2 else 1
    fig, axes = plt.subplots(1, ncols, figsize=(max(6.0, 1.3 * len(rows)) * ncols, 4.2), squeeze=False)
    ax = axes[0][0]
    for i, lb in enumerate(labels):
        med = [r[lb]["call"]["median"] for r in rows]
        err = [[m - r[lb]["call"]["p10"] for m, r in zip(med, rows)], [r[lb]["call"]["p90"] - m for m, r in zip(med, rows)]]
        ax.bar([v + (i - (len(labels) - 1) / 2) * width for v in x], med, width, yerr=err, capsize=2, label=lb)
    ax.set_yscale("log")
    ax.set_ylabel("host µs per op call (median, p10-p90)")
    ax.set_xticks(x, names, fontsize=7)
    ax.legend()
    ax.set_title("Eager host cost of one cached-op call")
    if ncols == 2:
        ax = axes[0][1]
        ax.bar(x, [r["ratio"] for r in rows], 0.6, color="gray")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(f"{labels[1]} / {labels[0]} (median µs/call)")
        ax.set_xticks(x, names, fontsize=7)
        ax.set_title("Ratio (1.0 = unchanged)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parent_main(args: argparse.Namespace) -> None:
    if args.root:
        root = Path(args.root).resolve()
        roots = {root.name: root}
    else:
        roots = {"old": Path(args.old_root).resolve(), "new": Path(args.new_root).resolve()}
    for label, root in roots.items():
        if not (root / "autodeploy_mla" / "__init__.py").is_file():
            raise SystemExit(f"{label} root {root} has no autodeploy_mla package (see the docstring for "
                             "how to extract the baseline)")
    runs = run_rounds(roots, args)
    labels = list(roots)
    if not args.root:  # label by the API each root actually has
        apis = {lb: runs[lb][0]["api"] for lb in labels}
        if apis != {"old": "old", "new": "new"}:
            print(f"warning: roots have APIs {apis}", file=sys.stderr)
    results = {lb: merge(runs[lb]) for lb in labels}
    rows = build_rows(results, labels)
    meta = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "machine": runs[labels[0]][0]["machine"], "roots": {lb: str(r) for lb, r in roots.items()},
            "git": git_state(), "new_via": args.new_via, "device": args.device, "dtype": args.dtype, "calls": args.calls,
            "warmup": args.warmup, "calls_per_step": args.calls_per_step, "rounds": args.rounds, "pin_cpu": args.pin_cpu,
            "cpu_threads": args.cpu_threads if args.device == "cpu" else None}
    lines = table(rows, labels)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        raw = {lb: [{"api": run["api"], "cases": run["cases"]} for run in runs[lb]] for lb in labels}
        (out / "op_host_cost.json").write_text(json.dumps(
            {**meta, "rows": rows, "skipped": {lb: runs[lb][0]["skipped"] for lb in labels},
             "raw_samples_us": raw}, indent=1))
        write_markdown(out / "op_host_cost.md", rows, labels, meta, runs)
        write_plot(out / "op_host_cost.png", rows, labels)
        print(f"wrote {out}/op_host_cost.{{json,md,png}}", file=sys.stderr)
    for label in labels:
        for s in runs[label][0]["skipped"]:
            print(f"[{label}] skipped {s['backend']}: {s['reason']}")
    print(f"\n{meta['machine']['device']}, {args.dtype}, median host µs per cached-op call "
          f"({args.calls} calls x {args.rounds} round(s) per root)")
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--root", default=None, help="measure only this code root (no comparison)")
    ap.add_argument("--old-root", default=str(BASELINE))
    ap.add_argument("--new-root", default=str(REPO))
    ap.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--calls", type=int, default=200, help="timed calls per case (>= 200)")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up calls per case (>= 20)")
    ap.add_argument("--calls-per-step", type=int, default=10, help="op calls per step (layers)")
    ap.add_argument("--rounds", type=int, default=4, help="subprocess runs per root, alternating")
    ap.add_argument("--pin-cpu", type=int, default=-1,
                    help="pin every child process to this CPU (-1, default: no pinning; pinning puts torch's whole "
                         "intra-op thread pool on one core, which made FlashInfer's host planning 100x slower)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads on --device cpu (0 = torch's default); 1 keeps a shared CPU quieter")
    ap.add_argument("--new-via", default="op", choices=("op", "direct"),
                    help="how the new root's calls are made: through the registered op (the dispatcher, as a "
                         "graph node) or the backend's direct_call (what the piecewise runner calls); old: op")
    ap.add_argument("--via", default="op", choices=("op", "direct"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="directory for op_host_cost.{json,md,png}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device is None or args.dtype is None:
        import torch

        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


if __name__ == "__main__":
    a = parse_args()
    child_main(a) if a.child else parent_main(a)
