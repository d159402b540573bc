"""Small-message all-reduce latency: NCCL vs torch symmetric-memory one-shot / two-shot (TP decode).

Tensor-parallel decode all-reduces tokens x hidden activations (64 x 2048 bf16 = 256 KiB), 94 times
per step; at these sizes latency, not bandwidth, decides. This measures, per world size and token
count (each rank on `cuda:LOCAL_RANK`, launched by `autodeploy_mla.distributed.spawn`):

- `nccl`: `_c10d_functional.all_reduce` + `wait_tensor` (what the `shard` pass inserts),
- `one_shot`: `symm_mem.one_shot_all_reduce_copy` (copies x into this rank's symmetric buffer, then
  every rank reads all peers' buffers over NVLink and sums: one kernel, no NCCL),
- `two_shot`: x copied into the symmetric buffer, `symm_mem.two_shot_all_reduce_` (reduce-scatter +
  all-gather through peer memory, in place), copied out.

No multimem (NVLink multicast) op is used: multicast is unusable on the lent H200 hosts, and the
launcher keeps NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1. Every variant is first
checked against the exact sum (small-integer inputs from per-rank seeds, exact in bf16); a variant
that is wrong or raises is recorded with its error and not timed. Timing: `--calls` back-to-back
calls captured in one CUDA graph, `--reps` replays between CUDA events after a warm-up replay (the
graph column: what a captured decode step pays), and the same calls launched eagerly (the eager
column: host launch cost included). Per call = median replay / calls; the slowest rank's median
(ranks wait on each other, so the slowest decides); the mean over all replays is kept in the JSON.

    python -m benchmarks.tp.bench_all_reduce --out /tmp/ar                       # 2 and 4 GPUs
    python -m benchmarks.tp.bench_all_reduce --world-sizes 2,4 --tokens 1,64,1024 --out /tmp/ar
    python -m benchmarks.tp.bench_all_reduce --render /tmp/ar/all_reduce.json   # table + plot (CPU ok)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from benchmarks.lib import pyplot


VARIANTS = ("nccl", "one_shot", "two_shot")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICE_TYPE = "cuda"  # a CPU dry run of the plumbing (gloo, torch.cuda faked) sets "cpu"
ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_ALGO", "NCCL_PROTO")


def inputs(tokens: int, hidden: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input: integers in [-4, 4] (sums over <= 8 ranks are exact in bf16), made on the
    CPU from a (tokens, rank) seed so that every rank can rebuild every other rank's input."""
    g = torch.Generator().manual_seed(7919 * tokens + rank)
    return torch.randint(-4, 5, (tokens, hidden), generator=g).to(dtype)


def symm_buffer(numel: int, dtype: torch.dtype, dev: torch.device, group: str) -> tuple[Optional[torch.Tensor], dict[str, Any]]:
    """One symmetric buffer per rank for the largest message, rendezvoused once (a collective), so
    that no allocation or handle exchange happens inside a timed call or a graph capture."""
    import torch.distributed._symmetric_memory as symm_mem

    # enable_symm_mem_for_group was needed before torch 2.11; since, it is deprecated ("no need to call
    # this function anymore") and would only register an extra PrefixStore: called only where not deprecated.
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    info: dict[str, Any] = {"enable_symm_mem_for_group": "absent" if enable is None else
                            "skipped (deprecated)" if getattr(enable, "__deprecated__", None) else "called"}
    try:
        if info["enable_symm_mem_for_group"] == "called":
            enable(group)
        buf = symm_mem.empty(numel, dtype=dtype, device=dev)
        symm_mem.rendezvous(buf, group)
        info["backend"] = symm_mem.get_backend(dev) if hasattr(symm_mem, "get_backend") else None
        return buf, info
    except Exception as exc:  # noqa: BLE001 - symmetric memory unavailable: the symm variants record it
        info["error"] = f"symmetric memory: {type(exc).__name__}: {exc}"[:400]
        return None, info


def variants(x: torch.Tensor, buf: Optional[torch.Tensor], group: str) -> dict[str, Callable[[], torch.Tensor]]:
    """The three all-reduces of `x`; the symmetric ones use `buf[:numel]` (offset 0, x's shape)."""
    fc = torch.ops._c10d_functional
    view = buf[: x.numel()].view(x.shape) if buf is not None else None

    def nccl() -> torch.Tensor:
        return fc.wait_tensor(fc.all_reduce(x, "sum", group))

    def one_shot() -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", group)

    def two_shot() -> torch.Tensor:
        view.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group)
        return view.clone()  # the buffer is reused by the next call: a model must copy the result out

    return {"nccl": nccl, "one_shot": one_shot, "two_shot": two_shot}


def agree(err: Optional[str]) -> Optional[str]:
    """Every rank's verdict -> one (the first rank's error), so that all ranks time the same variants
    (a rank timing alone would wait forever in the collective)."""
    errs: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((f"rank {r}: {e}" for r, e in enumerate(errs) if e), None)


def max_over_ranks(x: float, dev: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def per_call_us(run: Callable[[], None], reps: int, calls: int) -> tuple[float, float]:
    """(median, mean) device µs per call of `reps` runs of `calls` calls each, with an event between
    runs. A barrier first aligns the ranks; the median drops a first run that absorbs leftover skew."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    dist.barrier()
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(reps):
        run()
        ev[i + 1].record()
    torch.cuda.synchronize()
    per_run = [ev[i].elapsed_time(ev[i + 1]) * 1e3 / calls for i in range(reps)]
    return statistics.median(per_run), ev[0].elapsed_time(ev[-1]) * 1e3 / (reps * calls)


def time_variant(fn: Callable[[], torch.Tensor], want: torch.Tensor, args: argparse.Namespace,
                 dev: torch.device) -> dict[str, Any]:
    """Eager then CUDA-graph timing of one checked variant; a graph whose last output is not the exact
    sum after the replays is recorded as an error (capture must not change the result)."""
    from benchmarks.lib import track_graph

    def eager() -> None:
        for _ in range(args.calls):
            fn()

    eager()  # warm-up
    med, mean = per_call_us(eager, args.reps, args.calls)
    res: dict[str, Any] = {"eager_us": max_over_ranks(med, dev), "eager_mean_us": max_over_ranks(mean, dev)}
    g, out = torch.cuda.CUDAGraph(), None
    track_graph(g)  # freed before the NCCL teardown even if this raises (a live graph blocks it)
    err: Optional[str] = None
    try:
        with torch.cuda.graph(g):
            for _ in range(args.calls):
                out = fn()
    except Exception as exc:  # noqa: BLE001 - recorded; the eager numbers stand
        err = f"capture: {type(exc).__name__}: {exc}"[:400]
    err = agree(err)  # before any replay: a rank replaying collectives alone would hang
    if err is None:
        try:
            g.replay()  # warm-up replay
            med, mean = per_call_us(g.replay, args.reps, args.calls)
            if not torch.equal(out, want):
                err = "wrong result after graph replays"
        except Exception as exc:  # noqa: BLE001
            err = f"replay: {type(exc).__name__}: {exc}"[:400]
        err = agree(err)
    torch.cuda.synchronize()
    g.reset()
    if err:
        res["graph_error"] = err
    else:
        res.update(graph_us=max_over_ranks(med, dev), graph_mean_us=max_over_ranks(mean, dev))
    return res


def bench_rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one world size: the symmetric buffer, then per token count check + time each variant."""
    from benchmarks.lib import env_info

    info = env_info()
    world, dev = info.world_size, torch.device(DEVICE_TYPE, info.local_rank)
    group = dist.group.WORLD.group_name
    dtype = DTYPES[args.dtype]
    buf, symm = symm_buffer(max(args.tokens) * args.hidden, dtype, dev, group)
    symm_err = agree(symm.get("error"))
    rows = []
    for t in args.tokens:
        xs = [inputs(t, args.hidden, r, dtype) for r in range(world)]
        x = xs[rank].to(dev)
        want = torch.stack(xs).float().sum(0).to(dtype).to(dev)
        row: dict[str, Any] = {"world_size": world, "tokens": t, "hidden": args.hidden,
                               "bytes": x.numel() * x.element_size(), "variants": {}}
        for name, fn in variants(x, buf, group).items():
            err = symm_err if name != "nccl" else None
            if err is None:
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    if not torch.equal(out, want):
                        err = f"wrong result: max |error| {(out.float() - want.float()).abs().max().item():g}"
                except Exception as exc:  # noqa: BLE001 - unsupported size, missing op, ...: recorded
                    err = f"{type(exc).__name__}: {exc}"[:400]
                err = agree(err)
            row["variants"][name] = {"error": err} if err else time_variant(fn, want, args, dev)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    return {"world_size": world, "rows": rows, "symm_mem": symm, "env": {k: os.environ.get(k) for k in ENV_VARS}}


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "platform": platform.platform(), "host": platform.node(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return env


def _us(r: dict[str, Any], v: str, mode: str) -> Optional[float]:
    return r["variants"].get(v, {}).get(f"{mode}_us")


def render(path: Path) -> None:
    """Markdown table + plot next to the JSON at `path` (also what a run writes at its end)."""
    data = json.loads(path.read_text())
    rows, env, s = data["rows"], data["environment"], data["settings"]
    vs = [v for v in VARIANTS if any(v in r["variants"] for r in rows)]
    head = ["world size", "tokens", "bytes"] + [f"{v} {m} µs" for v in vs for m in ("graph", "eager")]
    head += ["nccl/one_shot graph", "nccl/one_shot eager"]
    lines = [f"# All-reduce latency: NCCL vs symmetric memory ({env.get('gpu', '?')} x {env.get('gpus', '?')})", "",
             f"Command: `{data['command']}`. torch {env['torch']}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}.", "",
             f"Messages tokens x {s['hidden']} {s['dtype']}. µs per call: median of {s['reps']} runs of {s['calls']} "
             "back-to-back calls, the slowest rank's (graph = one CUDA graph replay per run; eager = launched from "
             "the host). Ratio > 1: one_shot is faster. `err`: see the errors below.", "",
             "| " + " | ".join(head) + " |", "|---:|---:|---:|" + "---:|" * (len(head) - 3)]
    errors: dict[tuple[str, str], list[str]] = {}  # (what, error) -> where
    for r in sorted(rows, key=lambda r: (r["world_size"], r["tokens"])):
        cells = [str(r["world_size"]), str(r["tokens"]), f"{r['bytes'] / 1024:g} KiB"]
        for v in vs:
            got = r["variants"].get(v, {})
            for what, err in ((v, got.get("error")), (f"{v} graph", got.get("graph_error"))):
                if err:
                    errors.setdefault((what, err), []).append(f"w{r['world_size']} t{r['tokens']}")
            for m in ("graph", "eager"):
                us = _us(r, v, m)
                cells.append("err" if got.get("error") or (m == "graph" and got.get("graph_error"))
                             else "-" if us is None else f"{us:.1f}")
        for m in ("graph", "eager"):
            a, b = _us(r, "nccl", m), _us(r, "one_shot", m)
            cells.append(f"{a / b:.2f}" if a and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    for w in data.get("worlds", []):
        if w.get("error"):
            errors.setdefault((f"world size {w['world_size']}", w["error"]), []).append("no rows")
    if errors:
        lines += ["", "Errors (not timed):"] + [
            f"- {what} ({', '.join(where)}): `{' '.join(e.split())[:300].replace('`', chr(39))}`"
            for (what, e), where in errors.items()]
    lines += ["", f"![plot]({path.with_suffix('.png').name})"]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    worlds = sorted({r["world_size"] for r in rows})
    for i, v in enumerate(vs):  # colour = variant, line style = world size
        for j, w in enumerate(worlds):
            pts = sorted((r["bytes"], _us(r, v, "graph")) for r in rows
                         if r["world_size"] == w and _us(r, v, "graph") is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4],
                        label=f"{v}, {w} GPUs")
    ax.set_xscale("log", base=2)
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda b, _: f"{b / 1024:g} KiB"))
    ax.set_yscale("log")
    ax.set_xlabel("message bytes per rank")
    ax.set_ylabel("µs per all-reduce (CUDA graph)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(f"all-reduce latency, {env.get('gpu', '?')}")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--world-sizes", type=ints, default=[2, 4], help="sizes above the GPU count are skipped")
    ap.add_argument("--tokens", type=ints, default=[1, 8, 64, 256, 1024], help="message rows (tokens)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per captured graph / eager run")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays (eager runs)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_all_reduce"))
    ap.add_argument("--render", type=Path, help="re-render table + plot from this JSON and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"bench_all_reduce needs a host with at least 2 CUDA GPUs (found {n}); "
              "use --render JSON to re-render an earlier result", file=sys.stderr)
        return 2
    for w in args.world_sizes:
        if not 2 <= w <= n:
            print(f"skipping world size {w}: {'needs >= 2 ranks' if w < 2 else f'this host has {n} GPUs'}")
    worlds = [w for w in args.world_sizes if 2 <= w <= n]
    if not worlds:
        print("no world size left to run", file=sys.stderr)
        return 2
    from benchmarks.lib import RankFailed, spawn

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "all_reduce.json"
    data: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(),
        "settings": {k: getattr(args, k) for k in ("world_sizes", "tokens", "hidden", "dtype", "calls", "reps")},
        "rows": [], "worlds": [],
    }
    for w in worlds:
        t0 = time.perf_counter()
        try:
            res = spawn(bench_rank, w, args, backend="nccl")
            data["rows"] += res.pop("rows")
            data["worlds"].append({**res, "seconds": time.perf_counter() - t0})
        except RankFailed as exc:  # e.g. a crashed CUDA context: keep the other world sizes
            print(f"world size {w} failed:\n{exc}", file=sys.stderr)
            data["worlds"].append({"world_size": w, "error": str(exc)[:2000]})
        print(f"world size {w}: {time.perf_counter() - t0:.0f}s", flush=True)
        path.write_text(json.dumps(data, indent=1, default=str))
    render(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
