"""Where a build's graph passes spend their time, at a published model's real layer count (issue 42:
start-up). Runs anywhere (CPU is fine: passes are host work).

The model is the published config's *structure* (layers, heads, MLA dims, layer kinds) with the expert
count, expert / dense intermediate sizes and the vocabulary shrunk, so the weights are small while the
exported graph has the published node count per layer (the graph does not depend on those sizes).
Prints the seconds of every pass and, with `--profile`, the top functions by cumulative time.

    python -m benchmarks.diagnostics.pass_times --model v2_lite            # 27 layers
    python -m benchmarks.diagnostics.pass_times --model glm_4_7_flash --layers 8 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time
from typing import Any, Optional

from benchmarks.lib import PUBLISHED, optimize

#: sizes that do not change the graph's structure, shrunk so that building the weights is cheap
SHRUNK = {"n_routed_experts": 8, "moe_intermediate_size": 64, "intermediate_size": 256, "vocab_size": 1000}


def structure_config(model: str, layers: Optional[int]) -> dict[str, Any]:
    cfg = dict(PUBLISHED[model])
    cfg.update({k: v for k, v in SHRUNK.items() if k in cfg or k == "vocab_size"})
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v2_lite", choices=sorted(PUBLISHED))
    ap.add_argument("--layers", type=int, default=None, help="default: the published layer count")
    ap.add_argument("--profile", action="store_true", help="cProfile the build; print the top 30 by cumulative time")
    ap.add_argument("--json", default=None, help="also write the per-pass seconds here")
    args = ap.parse_args(argv)
    hf = structure_config(args.model, args.layers)
    config = {"model": {"hf_config": hf, "dtype": "bfloat16", "device": "cpu", "init": "hashed"},
              "runtime": {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "page_size": 64},
              "transforms": {"piecewise": {"on_cpu": True, "compile": "none"}}}
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    om = optimize(None, config)
    if prof:
        prof.disable()
    total = time.perf_counter() - t0
    passes = {r.name: round(r.seconds, 3) for r in om.history if r.enabled}
    print(f"{args.model}: {hf['num_hidden_layers']} layers, build {total:.1f} s ({platform.node()}); passes "
          f"{sum(passes.values()):.1f} s")
    for name, s in passes.items():
        print(f"  {name:30s} {s:8.3f} s")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "layers": hf["num_hidden_layers"], "build_s": total, "passes_s": passes},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
