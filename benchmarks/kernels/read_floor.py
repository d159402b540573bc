#!/usr/bin/env python
"""The device-time floor of reading a decode's cache: the fastest pure read of the same bytes.

Issue 14 asks the N <= 32 decode core for >= 85% of 4.3 TB/s on rows of batch x kv >= 64 x 4096
(168-1208 MB of cache). A kernel that must read those bytes cannot beat a kernel that does nothing but
read them, timed the same way. This script times, for each such row and in the same run:

  - the Triton backend's decode core and FlashInfer's `run()` (as `bench_mla_kernels.py` does);
  - `tma_ring_sS`: the decode kernel's own TMA loader (gluon_common._loader: page id -> TMA copies
    into an S-stage ring) with a consumer that releases each tile as it lands (no compute), on the
    decode's grid (1, batch, splits) and on grids of other split counts;
  - `stream_*`: a Triton persistent streaming read of the cache as one flat buffer (vector loads summed
    in registers), swept over programs per SM, block size and warps;
  - `torch_sum`: torch's reduction over the same flat buffer;
  - `copy`: a device copy of the cache (reads and writes it; the "4.3 TB/s copy" reference);
  - `empty`: a launch that does nothing (what this timing method charges any kernel).

Every time is the median of `triton.testing.do_bench` (L2 flushed before each run) over a CUDA-graph
replay, as in bench_mla_kernels. Writes <out>/read_floor.{md,json,png}.

    python -m benchmarks.kernels.read_floor --out $OUT/rf
    python -m benchmarks.kernels.read_floor --report-from docs/benchmarks/read_floor.json --out docs/benchmarks
    python -m benchmarks.kernels.read_floor --smoke --out /tmp/rf     # CPU: the stream kernel through the interpreter
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.lib import (
    COPY_TBS,
    Case,
    DIMS,
    FlashInferDecode,
    GLUON_ERROR,
    PAGE,
    decode_core_triton,
    flashinfer_accepts,
    gluon_alloc_ring,
    gluon_loader,
    gluon_work_item,
    num_sms,
    time_us,
)
from benchmarks.lib import gluon_decode as GD


#: The issue's memory-bound rows: N <= 32 dims, batch x kv >= 64 x 4096.
ROW_DIMS = ("deepseek_v3_tp8_n16", "glm_4_7_flash_n20", "mistral_small_4_n32")
ROWS = ((32, 8192), (128, 2048), (128, 8192))
TARGET = 0.85


@triton.jit
def _stream_read(X, OUT, n_elems, BLOCK: tl.constexpr):
    # Persistent grid-stride read of a flat buffer; the sum keeps the loads alive.
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n_elems, step):
        acc += tl.load(X + start + offs, mask=start + offs < n_elems, other=0.0).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


@triton.jit
def _noop(OUT, n):
    if n < 0:
        tl.store(OUT, 0.0)


if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    @gluon.jit
    def _release(full, empty, n_tiles, STAGES: gl.constexpr):
        for t in range(n_tiles):
            s = t % STAGES
            mbarrier.wait(full.index(s), (t // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)

    @gluon.jit
    def tma_ring_kernel(kv_desc, kpe_desc, PAGE_TABLE, CU_SEQLEN, SEQ_LEN, seq_base, chunk_size, stride_pt_b,
                        R: gl.constexpr, DR: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
        # The decode kernel's work item, ring and loader; the consumer only releases tiles.
        BN: gl.constexpr = 64
        BLOCK_C: gl.constexpr = R // 2
        b, pid_s, tok, kv_limit, kv_lo, kv_hi = gluon_work_item(CU_SEQLEN, SEQ_LEN, seq_base, chunk_size, BN)
        if kv_lo >= kv_limit:
            return
        n_tiles = gl.cdiv(kv_hi - kv_lo, BN)
        kv0_s, kv1_s, kpe_s, full, empty = gluon_alloc_ring(gl.bfloat16, kv_desc, kpe_desc, STAGES, BN, BLOCK_C, DR)
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        pt_row = PAGE_TABLE + b.to(gl.int64) * stride_pt_b
        gl.warp_specialize(
            [(_release, (full, empty, n_tiles, STAGES)),
             (gluon_loader, (kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty, pt_row, kv_lo, n_tiles,
                           PAGE_SIZE, BLOCK_C, R, DR, BN, STAGES))],
            [1], [40])


def ring_stages(r: int, dr: int) -> list[int]:
    """Ring depths that fit one program's shared memory (no queries, no p: only the ring)."""
    tile = 64 * (r + dr) * 2
    return [s for s in (2, 3, 4, 5) if s * tile + 1024 <= GD.SMEM_LIMIT]


def measure_row(dims_name: str, b: int, kv: int, rep_ms: float, with_fi: bool, dev) -> dict:
    """One row: the decode core (ours, FlashInfer's) and every pure read, under do_bench's L2 flush
    ("zero"); then the decode cores and the best reads again under a clean flush ("read")."""
    d = DIMS[dims_name]
    r, dr = d.kv_lora_rank, d.qk_rope_head_dim
    case = Case(d, [(kv - 1, 1)] * b, torch.bfloat16, dev, seed=b * 7 + kv)
    row: dict = {"dims": dims_name, "N": d.num_heads, "R": r, "Dr": dr, "batch": b, "kv_len": kv,
                 "bytes": b * kv * (r + dr) * 2}
    row["target_us"] = row["bytes"] / (TARGET * COPY_TBS * 1e12) * 1e6
    fns: dict = {}

    run, q_abs, _, splits = decode_core_triton(case)
    row["triton_splits"] = splits
    fns["triton_core"] = run
    fi = None
    if with_fi and flashinfer_accepts(d)[0]:
        fi = FlashInferDecode(case, q_abs)
        fns["fi_core"] = fi.run

    flat = case.cache.view(-1)
    row["flat_bytes"] = flat.numel() * flat.element_size()
    sms = num_sms(dev)
    out = torch.empty(sms * 8, device=dev, dtype=torch.float32)
    fns["empty"] = lambda: _noop[(1,)](out, 1)
    for per_sm in (1, 2, 4, 8):
        for block in (4096, 8192):
            for warps in (4, 8):
                grid = (sms * per_sm,)
                fns[f"stream_p{per_sm}_b{block}_w{warps}"] = (
                    lambda g=grid, bl=block, w=warps: _stream_read[g](flat, out, flat.numel(), BLOCK=bl, num_warps=w))
    fns["torch_sum"] = lambda: torch.sum(flat, dtype=torch.float32)
    dst = torch.empty_like(flat)
    fns["copy"] = lambda: dst.copy_(flat)
    if GLUON_ERROR is None and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9:
        descs = GD.cache_descriptors(case.cache, r, dr)
        info = case.info
        pt, cu, sl = info.get("page_table"), info.get("cu_seqlen"), info.get("seq_len_with_cache")
        for s_count in sorted({splits, 1, 2, 4, 8, 16}):
            if b * s_count > 16 * sms:
                continue
            for stages in ring_stages(r, dr):
                name = f"tma_ring_s{stages}_split{s_count}" + (" (decode grid)" if s_count == splits else "")
                fns[name] = (lambda g=(1, b, s_count), st=stages: tma_ring_kernel[g](
                    descs[0], descs[1], pt, cu, sl, 0, 128, pt.stride(0), R=r, DR=dr, PAGE_SIZE=PAGE, STAGES=st,
                    num_warps=4))
    variants = {k: time_us(f, graph=True, rep_ms=rep_ms)[0] for k, f in fns.items()}
    row["triton_core_us"] = variants.pop("triton_core")
    if "fi_core" in variants:
        row["fi_core_us"] = variants.pop("fi_core")
    row["variants_us"] = variants
    reads = {k: v for k, v in variants.items() if k not in ("empty", "copy")}
    best = min(reads, key=reads.get)
    row["floor_variant"], row["floor_us"] = best, reads[best]
    row["floor_tbs"] = row["bytes"] / (row["floor_us"] * 1e-6) / 1e12
    row["copy_tbs"] = 2 * row["flat_bytes"] / (variants["copy"] * 1e-6) / 1e12
    row["triton_tbs"] = row["bytes"] / (row["triton_core_us"] * 1e-6) / 1e12
    row["target_reachable"] = row["floor_us"] <= row["target_us"]

    # The same under a clean flush: the decode cores, the five fastest reads, the empty launch.
    again = ["triton_core", "fi_core", "empty"] + sorted(reads, key=reads.get)[:5]
    clean = {k: time_us(fns[k], graph=True, rep_ms=rep_ms, flush="read")[0] for k in again if k in fns}
    row["clean"] = {"us": clean}
    creads = {k: v for k, v in clean.items() if k not in ("empty", "triton_core", "fi_core")}
    cbest = min(creads, key=creads.get)
    row["clean"].update(floor_variant=cbest, floor_us=creads[cbest],
                        triton_tbs=row["bytes"] / (clean["triton_core"] * 1e-6) / 1e12,
                        floor_tbs=row["bytes"] / (creads[cbest] * 1e-6) / 1e12)
    return row


def render(res: dict, out: Path) -> None:
    rows = res["rows"]
    lines = [
        "# Read floor of the N <= 32 decode rows",
        "",
        f"Machine: {res['machine']}, {res['when']}. Command: `{res['command']}`.",
        "",
        "Issue 14's memory-bound target: the decode core at >= 85% of 4.3 TB/s on rows of batch x kv >= 64 x 4096. "
        "*floor* is the fastest pure read of the same cache found here (no kernel that must read the bytes "
        "can be faster than one that only reads them), *target* the time 85% of 4.3 TB/s allows. All times "
        "are CUDA-graph replays in the same run; this first table under `triton.testing.do_bench`'s own L2 flush "
        "(it zeroes 256 MB), as `bench_mla_kernels.py` times by default.",
        "",
        "| dims | B | kv | MB | target µs | triton core µs | FI core µs | floor µs | floor TB/s | floor variant "
        "| tma ring (decode grid) µs | torch sum µs | copy TB/s | empty µs | floor ≤ target? |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants_us"]
        ring = [x for k, x in v.items() if "(decode grid)" in k]
        fi = f"{r['fi_core_us']:.1f}" if "fi_core_us" in r else "—"
        ring_us = f"{min(ring):.1f}" if ring else "—"
        lines.append(
            f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {r['bytes'] / 1e6:.0f} | {r['target_us']:.1f} "
            f"| {r['triton_core_us']:.1f} | {fi} | {r['floor_us']:.1f} | {r['floor_tbs']:.2f} | {r['floor_variant']} "
            f"| {ring_us} | {v['torch_sum']:.1f} | {r['copy_tbs']:.2f} | {v['empty']:.1f} "
            f"| {'yes' if r['target_reachable'] else 'no: unreachable'} |")
    lines += ["", "## The same rows under a clean L2 flush (`flush=\"read\"`)", "",
              "do_bench's flush zeroes 256 MB, so L2 starts full of dirty lines and the timed kernel's first reads "
              "wait for their write-back. Here the flush reads 256 MB instead: L2 is as cold, with nothing to write "
              "back (a decode step's attention follows small GEMMs, not a 256 MB write).", "",
              "| dims | B | kv | target µs | triton core µs | triton TB/s | %4.3 | FI core µs | floor µs | floor TB/s "
              "| floor variant | empty µs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("clean")
        if not c:
            continue
        fi = f"{c['us']['fi_core']:.1f}" if "fi_core" in c["us"] else "—"
        lines.append(f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {r['target_us']:.1f} | {c['us']['triton_core']:.1f} "
                     f"| {c['triton_tbs']:.2f} | {100 * c['triton_tbs'] / COPY_TBS:.0f} | {fi} | {c['floor_us']:.1f} "
                     f"| {c['floor_tbs']:.2f} | {c['floor_variant']} | {c['us']['empty']:.1f} |")
    lines += ["", "## Every variant (µs)", ""]
    names = sorted({k for r in rows for k in r["variants_us"]})
    lines.append("| variant | " + " | ".join(f"{r['dims'].split('_')[0]} {r['batch']}x{r['kv_len']}" for r in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{r['variants_us'][n]:.1f}" if n in r["variants_us"] else "—"
                                                for r in rows) + " |")
    if res.get("notes"):
        lines += ["", "## Reading", ""] + res["notes"]
    (out / "read_floor.md").write_text("\n".join(lines) + "\n")
    from benchmarks.lib import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows))
    labels = [f"{r['dims'].split('_')[0]} N{r['N']}\n{r['batch']}x{r['kv_len']}" for r in rows]
    for key, name in (("target_us", "85% target"), ("floor_us", "read floor"), ("triton_core_us", "triton core"),
                      ("fi_core_us", "FlashInfer core")):
        ax.plot(xs, [r.get(key, float("nan")) / r["target_us"] for r in rows], "o-", label=name)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("time / 85% target")
    ax.legend()
    ax.set_title("N <= 32 decode rows: time relative to 85% of 4.3 TB/s")
    fig.tight_layout()
    fig.savefig(out / "read_floor.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--dims", nargs="*", default=list(ROW_DIMS))
    ap.add_argument("--rep-ms", type=float, default=10)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one tiny row on CPU (stream kernel through the interpreter)")
    ap.add_argument("--report-from", metavar="JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_from:
        render(json.loads(Path(args.report_from).read_text()), out)
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        d = DIMS["deepseek_v3_tp8_n16"]
        case = Case(d, [(63, 1)] * 2, torch.bfloat16, dev, seed=1)
        flat = case.cache.view(-1)
        got = torch.empty(2, device=dev, dtype=torch.float32)
        _stream_read[(2,)](flat, got, flat.numel(), BLOCK=4096)
        want = flat.float().sum()
        ok = torch.allclose(got.sum(), want, rtol=1e-3, atol=1e-1)
        print(f"smoke: stream read sum {got.sum().item():.3f} vs torch {want.item():.3f}: {'ok' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    res = {"machine": f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}",
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m benchmarks.kernels.read_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
           "host": platform.node(), "rows": []}
    try:
        import flashinfer

        res["machine"] += f", flashinfer {flashinfer.__version__}"
    except ImportError:
        pass
    for name in args.dims:
        for b, kv in ROWS:
            row = measure_row(name, b, kv, args.rep_ms, not args.no_flashinfer, dev)
            res["rows"].append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{name} B{b} kv{kv}: target {row['target_us']:.1f} triton {row['triton_core_us']:.1f} "
                  f"FI {row.get('fi_core_us', float('nan')):.1f} floor {row['floor_us']:.1f} "
                  f"({row['floor_variant']}, {row['floor_tbs']:.2f} TB/s) empty {row['variants_us']['empty']:.1f}",
                  flush=True)
            (out / "read_floor.json").write_text(json.dumps(res, indent=1))
    render(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
