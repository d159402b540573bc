"""Launch configs of the DSA indexer's score kernel (`index_scores_kernel`) at decode depth.

The DeepSeek-V3.2 indexer (64 heads x 128, bf16 index cache, pages of 64) scores every cached key of
each of `--batch` decode tokens at `--context` cached tokens; issue 45 measured it at half of a sparse
decode step. Each config (heads per MMA, keys per tile, tiles per program, warps, stages) is checked
against an fp32 torch reference on a few rows, then timed as a CUDA-graph replay; the byte floor is
the index keys read once plus the fp32 score row written, over the copy bandwidth measured in the
same run. `torch.topk` over the score rows (the selection after it) is timed too.

    python -m benchmarks.kernels.sweep_index_scores --out /tmp/idx      # H200: table + JSON
    python -m benchmarks.kernels.sweep_index_scores --quick --out /tmp/x # CPU (TRITON_INTERPRET=1), tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.lib import (IndexScoresConfig, command, index_scores_config, launch_index_scores, machine,
                            measure_peaks, time_us)


def case(batch: int, context: int, heads: int, dim: int, page: int, dtype: torch.dtype, dev: str) -> dict[str, Any]:
    """A paged index cache (pages shuffled), one decode token per sequence at position context - 1."""
    g = torch.Generator(device=dev).manual_seed(batch * 31 + context)
    pages_per = -(-context // page)
    num_pages = batch * pages_per
    keys = torch.randn(num_pages * page, dim, generator=g, device=dev).to(dtype)
    perm = torch.randperm(num_pages, generator=g, device=dev).to(torch.int32)
    return {"q": torch.randn(batch, heads, dim, generator=g, device=dev).to(dtype),
            "w": torch.rand(batch, heads, generator=g, device=dev),
            "keys": keys, "page_table": perm.view(batch, pages_per).contiguous(),
            "tok_seq": torch.arange(batch, device=dev, dtype=torch.int32),
            "tok_pos": torch.full((batch,), context - 1, device=dev, dtype=torch.int32),
            "seq_len": torch.full((batch,), context, device=dev, dtype=torch.int32),
            "scores": torch.empty(batch, pages_per * page, device=dev), "page": page, "scale": dim ** -0.5}


def reference_rows(c: dict[str, Any], rows: list[int]) -> torch.Tensor:
    """fp32 scores of a few tokens: gather each one's keys through its page table, score them."""
    page, out = c["page"], []
    for t in rows:
        slots = (c["page_table"][t].long()[:, None] * page + torch.arange(page, device=c["keys"].device)).reshape(-1)
        k = c["keys"][slots].float()
        s = torch.relu(c["q"][t].float() @ k.T * c["scale"])  # [H, kv]
        out.append((c["w"][t].float()[:, None] * s).sum(0))
    return torch.stack(out)


def configs(quick: bool) -> list[Any]:
    cfg = IndexScoresConfig
    if quick:
        return [cfg(16, 32, 1, 1, 1), cfg(16, 16, 2, 1, 1)]
    grid = itertools.product((16, 64), (32, 64, 128), (1, 4), (4, 8), (2, 3))
    current = index_scores_config(64, 128, torch.bfloat16, compiled=True)
    return [current] + [c for c in (cfg(*g) for g in grid) if c != current]


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    c = case(args.batch, args.context, args.heads, args.dim, args.page, dtype, dev)
    launch = launch_index_scores
    chosen = index_scores_config(args.heads, args.dim, dtype, compiled=not args.quick)
    peaks = measure_peaks(torch.device(dev), args.quick)
    key_bytes = c["keys"].numel() * c["keys"].element_size()
    score_bytes = c["scores"].numel() * 4
    # copy_gb_s counts read + write: a stream that only reads (keys) or only writes (scores) moves at it
    floor_us = (key_bytes + score_bytes) / (peaks["copy_gb_s"] * 1e9) * 1e6
    check_rows = [0, args.batch - 1]
    ref = reference_rows(c, check_rows)

    def call(cfg):
        return lambda: launch(cfg, c["q"], c["w"], c["keys"], c["page_table"], c["tok_seq"], c["tok_pos"],
                              c["seq_len"], c["scores"], c["scale"], c["page"])

    rows = []
    for cfg in configs(args.quick):
        row: dict[str, Any] = {"config": dataclasses.asdict(cfg), "chosen": cfg == chosen}
        try:
            call(cfg)()
            got = c["scores"][check_rows, :args.context]
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            row["rel_err"] = err
            if err > (1e-5 if args.quick else 2e-2):
                raise AssertionError(f"scores differ from the fp32 reference: max rel err {err:.3g}")
            row["us"], row["how"] = time_us(call(cfg), graph=not args.quick, rep_ms=args.rep_ms)
            row["x_floor"] = row["us"] / floor_us
        except Exception as e:  # noqa: BLE001 - a config that fails is a row, the sweep goes on
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    topk_us, _ = time_us(lambda: torch.topk(c["scores"], min(args.topk, c["scores"].shape[1]), dim=-1),
                         graph=not args.quick, rep_ms=args.rep_ms)
    return {"command": command(), "machine": machine(command()), "shape": {k: getattr(args, k) for k in (
            "batch", "context", "heads", "dim", "page", "topk")}, "dtype": str(dtype), "peaks": peaks,
            "floor_us": floor_us, "key_bytes": key_bytes, "score_bytes": score_bytes, "topk_us": topk_us,
            "rows": rows}


def render(res: dict[str, Any], out: Path) -> None:
    ok = sorted((r for r in res["rows"] if "us" in r), key=lambda r: r["us"])
    chosen = [r for r in res["rows"] if r.get("chosen")]
    s = res["shape"]
    lines = [f"# DSA indexer scores: launch configs (batch {s['batch']} x context {s['context']}, {s['heads']} heads x "
             f"{s['dim']}, {res['dtype']})", "", f"Command: `{res['command']}`", "",
             f"Byte floor (keys {res['key_bytes'] / 1e6:.0f} MB + scores {res['score_bytes'] / 1e6:.0f} MB at the "
             f"measured copy bandwidth): {res['floor_us']:.1f} us; torch.topk(k={s['topk']}) over the scores: "
             f"{res['topk_us']:.1f} us.", "",
             "| block_h | block_n | kv_iters | warps | stages | us | x floor | rel err |", "|---|---|---|---|---|---|---|---|"]
    for r in ok[:12] + [r for r in chosen if r not in ok[:12]]:
        k = r["config"]
        lines.append(f"| {k['block_h']} | {k['block_n']} | {k['kv_iters']} | {k['num_warps']} | {k['num_stages']} | "
                     f"{r['us']:.1f}{' (current)' if r.get('chosen') else ''} | {r.get('x_floor', 0):.2f} | "
                     f"{r['rel_err']:.1e} |")
    bad = [r for r in res["rows"] if "error" in r]
    if bad:
        lines += ["", f"{len(bad)} configs failed, e.g. {bad[0]['config']}: {bad[0]['error']}"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_scores_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "index_scores_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    print("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/index_scores")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rep-ms", type=float, default=25)
    ap.add_argument("--quick", action="store_true", help="tiny shape on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.heads, args.dim, args.page, args.topk = 2, 40, 5, 16, 8, 8
    res = run(args)
    render(res, Path(args.out))
    return 0 if any("us" in r for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
