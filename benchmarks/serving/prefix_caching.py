"""Prefix caching (issue 46): the two target workloads with `runtime.prefix_caching` on and off.

Workloads (`autodeploy_mla.serving.bench`, the ones `autodeploy bench --shared-prefix` and
`--multi-turn` run), greedy, ignore_eos, all arriving at once:

- `shared prefix`: 64 requests sharing one 1536-token prefix + 256 unique tokens each, 128 out;
  target on the H200: TTFT p50 <= 0.3x and throughput >= 1.5x the same run with caching off;
- `multi-turn`: 16 conversations x 6 turns, first prompt 512 tokens, 64-token questions and 64-token
  answers (turn t+1 = turn t's prompt + its answer + a question, sent when turn t finished);
  target: TTFT p50 per turn flat in the number of turns;
- `no sharing`: 64 requests of 1792 unique tokens each (the shared-prefix run's lengths), 128 out;
  target: caching on no slower than off by more than noise. Noise is measured, not assumed: the off
  process runs twice (off, on, off: both orders around the on run), and the two off runs' spread is
  what "noise" means in the table.

Model: the published DeepSeek-V2-Lite config (bf16, random weights, backend auto), runtime from
model_configs/deepseek_v2.yaml. Caching on and off run in separate processes (one build each, so
nothing of one run's cache or compile state reaches the other); in each, after warm-up, one untimed
pass of each workload with another seed (compiles what the steps need), then the cache is cleared
(`PageAllocator.clear_cache`) and the timed pass runs.

    python -m benchmarks.serving.prefix_caching                         # on the GPU -> docs/benchmarks/prefix_caching.*
    python -m benchmarks.serving.prefix_caching --render docs/benchmarks/prefix_caching.json   # table + plot again
    python -m benchmarks.serving.prefix_caching --quick --out /tmp/pc   # CPU, tiny model and workloads (the test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

WORKLOADS = {
    "full": {"shared": {"num_requests": 64, "prefix_len": 1536, "unique_len": (256, 256), "output_len": (128, 128)},
             "unique": {"num_requests": 64, "prompt_len": (1792, 1792), "output_len": (128, 128)},
             "multi_turn": {"num_conversations": 16, "turns": 6, "first_len": (512, 512), "question_len": (64, 64),
                            "output_len": (64, 64)}},
    "quick": {"shared": {"num_requests": 8, "prefix_len": 48, "unique_len": (16, 16), "output_len": (4, 4)},
              "unique": {"num_requests": 8, "prompt_len": (64, 64), "output_len": (4, 4)},
              "multi_turn": {"num_conversations": 2, "turns": 3, "first_len": (24, 24), "question_len": (8, 8),
                             "output_len": (4, 4)}},
}
QUICK_RUNTIME = {"max_seq_len": 256, "page_size": 16, "max_num_tokens": 64, "max_batch_size": 8}


def workloads(size: str, vocab: int, seed: int) -> dict[str, Any]:
    from benchmarks.lib import serving_bench

    Workload = serving_bench.Workload

    w = WORKLOADS[size]
    s, m, u = w["shared"], w["multi_turn"], w["unique"]
    return {"shared prefix": Workload.shared_prefix(s["num_requests"], s["prefix_len"], s["unique_len"],
                                                    s["output_len"], vocab, seed=seed),
            "multi-turn": Workload.multi_turn(m["num_conversations"], m["turns"], m["first_len"], m["question_len"],
                                              m["output_len"], vocab, seed=seed),
            "no sharing": Workload.synthetic(u["num_requests"], u["prompt_len"], u["output_len"], vocab, seed=seed)}


# ----------------------------------------------------------------------------- one process: caching on or off
def child(spec_path: Path) -> None:
    """Build once with runtime.prefix_caching as the spec says, run both workloads, write JSON."""
    import torch

    from benchmarks.lib import optimize
    from benchmarks.lib import serving_bench as bench

    spec = json.loads(spec_path.read_text())
    quick = spec["size"] == "quick"
    layer: dict[str, Any] = {"model": {"device": spec["device"], "dtype": "float32" if quick else "bfloat16"},
                             "runtime": {"prefix_caching": spec["caching"], **(QUICK_RUNTIME if quick else {})}}
    if not quick:
        from benchmarks.lib import V2_LITE

        layer["model"]["hf_config"] = V2_LITE
    t0 = time.perf_counter()
    om = optimize("deepseek_v2", [layer])
    om.warmup()
    out: dict[str, Any] = {"caching": spec["caching"], "build_s": time.perf_counter() - t0, "runs": {}}
    warm = workloads(spec["size"], om.vocab_size, seed=101)
    timed = workloads(spec["size"], om.vocab_size, seed=0)
    for name, wl in timed.items():
        bench.run_in_process(om, warm[name])  # untimed: what the steps compile at first use
        om.allocator.clear_cache()
        res = bench.run_in_process(om, wl)
        res["label"] = f"{name}, caching {'on' if spec['caching'] else 'off'}"
        res["workload"] = wl.description
        res["pages_cached_after"] = om.allocator.num_cached
        out["runs"][name] = res
    out["device"] = str(om.device)
    if om.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(om.device)
    Path(spec["out"]).write_text(json.dumps(out, default=str))


def run_child(size: str, device: str, caching: bool, tmp: Path, tag: str = "") -> dict[str, Any]:
    spec = tmp / f"spec_{'on' if caching else 'off'}{tag}.json"
    res = tmp / f"result_{'on' if caching else 'off'}{tag}.json"
    spec.write_text(json.dumps({"size": size, "device": device, "caching": caching, "out": str(res)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving.prefix_caching", "--child", str(spec)], cwd=REPO,
                          capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the caching={'on' if caching else 'off'} run failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(res.read_text())


# ----------------------------------------------------------------------------- report
def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def no_sharing_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Caching on vs off on the workload with nothing to share, against the spread of the two off
    runs (the noise): empty for a JSON written before the workload existed."""
    name, again = "no sharing", doc.get("off_again")
    if again is None or name not in doc["on"]["runs"]:
        return {}
    on, off, off2 = (d["runs"][name] for d in (doc["on"], doc["off"], again))
    off_tps = (off["tokens_per_s"] + off2["tokens_per_s"]) / 2
    off_ttft = (off["ttft_ms"]["p50"] + off2["ttft_ms"]["p50"]) / 2
    tps, ttft = on["tokens_per_s"] / off_tps, on["ttft_ms"]["p50"] / off_ttft
    noise_tps = abs(off["tokens_per_s"] - off2["tokens_per_s"]) / off_tps
    noise_ttft = abs(off["ttft_ms"]["p50"] - off2["ttft_ms"]["p50"]) / off_ttft
    slower = (1 - tps) > max(noise_tps, 0.0) or (ttft - 1) > max(noise_ttft, 0.0)
    line = (f"No sharing, on / mean of the two off runs: throughput {tps:.3f}x, TTFT p50 {ttft:.3f}x; noise (the off "
            f"runs' spread): throughput {noise_tps:.1%}, TTFT p50 {noise_ttft:.1%} -> "
            f"{'SLOWER than noise (target missed)' if slower else 'within noise (target: no slowdown beyond noise)'}.")
    return {"line": line, "nosharing_throughput_ratio": tps, "nosharing_ttft_p50_ratio": ttft,
            "nosharing_noise_throughput": noise_tps, "nosharing_noise_ttft_p50": noise_ttft,
            "nosharing_slower_than_noise": slower}


def render(doc: dict[str, Any], out: Path, stem: str = "prefix_caching") -> list[Path]:
    on, off = doc["on"], doc["off"]
    lines = [f"# Prefix caching: caching on vs off ({doc['meta']['size']})", "",
             f"`{doc['meta']['command']}` on {doc['meta'].get('gpu') or doc['meta']['device']}, "
             f"{doc['meta']['date']}.", "",
             "| workload | caching | requests | tokens/s | TTFT p50 / p90 ms | cached prompt tokens | hit rate |",
             "|---|---|---:|---:|---|---:|---:|"]
    for name in on["runs"]:
        sides = [("on", on), ("off", off)] + ([("off, again", doc["off_again"])] if doc.get("off_again") else [])
        for tag, side in sides:
            if name not in side["runs"]:
                continue
            r = side["runs"][name]
            q, h = r.get("prefix_query_tokens") or 0, r.get("prefix_hit_tokens") or 0
            lines.append(f"| {name} | {tag} | {r['requests'] - r['failed']}/{r['requests']} | {_f(r['tokens_per_s'])} | "
                         f"{_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p90'])} | {r.get('cached_tokens', 0)} | "
                         f"{_f(100 * h / q) + '%' if q else '-'} |")
    s_on, s_off = on["runs"]["shared prefix"], off["runs"]["shared prefix"]
    ttft = s_on["ttft_ms"]["p50"] / s_off["ttft_ms"]["p50"] if s_off["ttft_ms"]["p50"] else None
    tput = s_on["tokens_per_s"] / s_off["tokens_per_s"] if s_off["tokens_per_s"] else None
    lines += ["", f"Shared prefix, on / off: TTFT p50 {_f(ttft, 3)}x (target <= 0.3x), throughput {_f(tput, 2)}x "
                  "(target >= 1.5x; the targets are for the full-size run on the H200)."]
    nosharing = no_sharing_summary(doc)
    if nosharing:
        lines += ["", nosharing["line"]]
    m_on, m_off = on["runs"]["multi-turn"], off["runs"]["multi-turn"]
    turns = sorted(int(k) for k in m_on.get("per_turn", {}))
    lines += ["", "Multi-turn, TTFT p50 ms per turn (target: flat with caching on):", "",
              "| caching | " + " | ".join(f"turn {k}" for k in turns) + " |", "|---|" + "---:|" * len(turns)]
    for tag, r in (("on", m_on), ("off", m_off)):
        lines.append(f"| {tag} | " + " | ".join(_f(r["per_turn"][str(k)]["ttft_ms"]["p50"]) for k in turns) + " |")
    doc["summary"] = {"shared_ttft_p50_ratio": ttft, "shared_throughput_ratio": tput,
                      **{k: v for k, v in (nosharing or {}).items() if k != "line"}}
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.md", out / f"{stem}.json"]
    paths[0].write_text("\n".join(lines) + "\n")
    paths[1].write_text(json.dumps(doc, indent=2, default=str))
    print("\n".join(lines))
    from benchmarks.lib import pyplot

    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        a.bar(["TTFT p50 (ms)", "tokens/s / 10"], [s_off["ttft_ms"]["p50"], s_off["tokens_per_s"] / 10], width=-0.4,
              align="edge", label="off")
        a.bar(["TTFT p50 (ms)", "tokens/s / 10"], [s_on["ttft_ms"]["p50"], s_on["tokens_per_s"] / 10], width=0.4,
              align="edge", label="on")
        a.set_title("shared prefix")
        a.legend()
        for tag, r in (("off", m_off), ("on", m_on)):
            b.plot(turns, [r["per_turn"][str(k)]["ttft_ms"]["p50"] for k in turns], marker="o", label=f"caching {tag}")
        b.set_xlabel("turn")
        b.set_ylabel("TTFT p50 (ms)")
        b.set_title("multi-turn")
        b.legend()
        fig.tight_layout()
        paths.append(out / f"{stem}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    ap.add_argument("--quick", action="store_true", help="tiny model and workloads on the CPU (checks the script)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --quick")
    ap.add_argument("--render", type=Path, help="a JSON this script wrote: write its table and plot again")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child)
    if args.render is not None:
        render(json.loads(args.render.read_text()), args.out)
        return
    size = "quick" if args.quick else "full"
    device = args.device or ("cpu" if args.quick else "cuda")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="prefix_caching_") as tmp:
        off = run_child(size, device, False, Path(tmp))
        on = run_child(size, device, True, Path(tmp))
        off_again = run_child(size, device, False, Path(tmp), tag="_again")
    meta = {"command": "python -m benchmarks.serving.prefix_caching " + " ".join(sys.argv[1:]), "size": size,
            "device": on["device"], "gpu": on.get("gpu"), "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "workloads": WORKLOADS[size]}
    for p in render({"meta": meta, "on": on, "off": off, "off_again": off_again}, args.out):
        print(f"written: {p}")


if __name__ == "__main__":
    main()
