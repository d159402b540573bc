"""Start-up benchmark (issue 42, item 2): time to a ready model, cold and with an earlier run's caches.

Each run is a fresh Python process (`--child`) that builds the model (`optimize`), warms it up
(`om.warmup()`: compiles + CUDA graphs), then serves a few requests and checks that they compiled and
captured nothing more. It records the wall seconds of build and warm-up and, where the product has it,
`om.startup().to_dict()` (load, passes, compile per group with cache hits/misses, captures per kind).

Runs, in order, each in its own process:
- `cold`: an empty cache root (`AUTODEPLOY_CACHE_DIR=<out>/cache`, emptied first): what a fresh machine pays
  (Inductor, Triton and FlashInfer JIT caches all empty);
- `warm`: the same root again: what a restart on the same machine pays.
`--baseline-root DIR` adds the same two runs of another checkout (e.g. main) with PYTHONPATH=DIR and
TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / FLASHINFER_WORKSPACE_BASE under <out>/baseline_cache (so its
cold run is cold too; it predates AUTODEPLOY_CACHE_DIR).

    python -m benchmarks.serving.startup --out $OUT/startup                        # V2-Lite, backend auto
    python -m benchmarks.serving.startup --out $OUT/startup --backend triton       # mixed graphs on
    python -m benchmarks.serving.startup --out $OUT/startup --baseline-root /path/to/main
    python -m benchmarks.serving.startup --out $OUT/startup_auto --set transforms.piecewise.dynamic_tokens=false
    python -m benchmarks.serving.startup --out /tmp/startup --quick --device cpu   # plumbing only (tiny model)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

from benchmarks.lib import PUBLISHED

FAMILY = {"v2_lite": "deepseek_v2", "glm_4_7_flash": "glm_4_7_flash"}


def child(spec_path: Path) -> None:
    """One start-up in this process; writes the result JSON next to the spec."""
    spec = json.loads(spec_path.read_text())
    t_import = time.perf_counter()
    import torch

    from benchmarks.lib import optimize

    layer: dict[str, Any] = {"model": {"device": spec["device"],
                                       "dtype": "bfloat16" if spec["device"] != "cpu" else "float32"}}
    if not spec["quick"]:
        layer["model"]["hf_config"] = PUBLISHED[spec["model"]]
    transforms: dict[str, Any] = {}
    if spec["backend"]:
        transforms["insert_cached_mla_attention"] = {"backend": spec["backend"]}
    if spec["device"] == "cpu":
        transforms["piecewise"] = {"on_cpu": True, "compile": "aot_eager"}
    if transforms:
        layer["transforms"] = transforms
    res: dict[str, Any] = {"label": spec["label"], "import_s": time.perf_counter() - t_import}
    t0 = time.perf_counter()
    om = optimize(FAMILY[spec["model"]], [layer], overrides=spec["set"])
    res["build_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    warm = om.warmup()
    if spec["device"] != "cpu":
        torch.cuda.synchronize()
    res["warmup_s"] = time.perf_counter() - t1
    res["ready_s"] = time.perf_counter() - t0
    res["warmup_steps"] = len(warm.get("steps", []))
    res["not_needed"] = list(warm.get("not_needed", {}))
    res["backends"] = sorted({d.backend for d in om.ctx.artifacts.decisions})
    startup = getattr(om, "startup", None)
    before = startup().to_dict() if startup is not None else None
    res["startup"] = before
    # a few requests of every kind of step: must neither compile nor capture (warm-up did it all)
    vocab = om.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate((5, 40, 300, 1500))]
    t2 = time.perf_counter()
    om.generate(prompts, max_new_tokens=8, ignore_eos=True)
    res["first_requests_s"] = time.perf_counter() - t2
    if startup is not None:
        after = startup().to_dict()
        res["after_requests"] = {"compiles": after["compile"]["compiles"] - before["compile"]["compiles"],
                                 "captures": after["capture"]["total"] - before["capture"]["total"]}
    summary = om.runner.piecewise.summary() if om.runner.piecewise is not None else {}
    res["captured"] = summary.get("captured")
    res["failures"] = summary.get("failures")
    (spec_path.parent / f"{spec['label']}.json").write_text(json.dumps(res, indent=2, default=str))


def run_child(label: str, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict[str, Any]:
    spec = {"label": label, "model": args.model, "device": args.device, "backend": args.backend, "quick": args.quick,
            "set": args.set if not label.startswith("baseline") else []}
    spec_path = out / f"{label}.spec.json"
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(spec_path)], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t
    (out / f"{label}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"label": label, "error": proc.stderr[-3000:], "process_s": wall}
    res = json.loads((out / f"{label}.json").read_text())
    res["process_s"] = wall
    return res


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['label']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} |||||||"
    st = r.get("startup") or {}
    comp, cap = st.get("compile", {}), st.get("capture", {})
    cache = comp.get("cache", {})
    hits = cache.get("fxgraph_cache_hit", 0) + cache.get("autograd_cache_hit", 0)
    misses = cache.get("fxgraph_cache_miss", 0) + cache.get("autograd_cache_miss", 0)
    after = r.get("after_requests", {})
    return (f"| {r['label']} | {r['build_s']:.1f} | {r['warmup_s']:.1f} | {r['ready_s']:.1f} | "
            f"{comp.get('groups', '-')}/{comp.get('compiles', '-')} in {comp.get('seconds', 0):.1f}s | "
            f"{hits}/{misses} | {cap.get('total', '-')} in {cap.get('total_seconds', 0):.1f}s | "
            f"{after.get('compiles', '-')}/{after.get('captures', '-')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=False)
    ap.add_argument("--model", default="v2_lite", choices=sorted(FAMILY))
    ap.add_argument("--backend", default="", help="insert_cached_mla_attention.backend (default: auto)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the family's tiny config (plumbing check)")
    ap.add_argument("--set", action="append", default=[], metavar="a.b=c",
                    help="config override for this checkout's runs, e.g. transforms.piecewise.dynamic_tokens=false")
    ap.add_argument("--baseline-root", type=Path, help="another checkout to run the same way (PYTHONPATH)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if args.out is None:
        ap.error("--out is required")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if k not in (
        "AUTODEPLOY_CACHE_DIR", "AUTODEPLOY_CACHE_VARS_SET", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE")}
    results = []
    env = {**base_env, "AUTODEPLOY_CACHE_DIR": str(fresh(out / "cache")), "PYTHONPATH": str(REPO)}
    for label in ("cold", "warm"):
        print(f"[startup] {label} ...", flush=True)
        results.append(run_child(label, args, env, out))
        print(row(results[-1]), flush=True)
    if args.baseline_root is not None:
        cache = fresh(out / "baseline_cache")
        # the old package first, then this checkout for `benchmarks`; PYTHONSAFEPATH: the working directory
        # (`python -m` puts it first otherwise) does not decide where autodeploy_mla comes from
        benv = {**base_env, "PYTHONPATH": os.pathsep.join([str(args.baseline_root), str(REPO)]), "PYTHONSAFEPATH": "1",
                "AUTODEPLOY_CACHE_DIR": "off",
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
                "FLASHINFER_WORKSPACE_BASE": str(cache / "flashinfer")}
        for label in ("baseline_cold", "baseline_warm"):
            print(f"[startup] {label} ...", flush=True)
            results.append(run_child(label, args, benv, out))
            print(row(results[-1]), flush=True)
    header = ("| run | build s | warm-up s | ready s | groups/compiles | cache hits/misses | captures | "
              "after requests: compiles/captures |\n|---|---|---|---|---|---|---|---|")
    sets = f", {' '.join(args.set)}" if args.set else ""
    md = f"# Start-up: {args.model}, backend {args.backend or 'auto'}, {args.device}{sets}\n\n{header}\n" + \
        "\n".join(row(r) for r in results) + "\n"
    (out / "startup.md").write_text(md)
    (out / "startup.json").write_text(json.dumps(results, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
