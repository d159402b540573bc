"""Warm up one model under a parallel layout on every rank and print what compiling cost per compile group.

Why: a compiled static piece must be dynamic in the token count (one compile per group, plus one for
T = 1); a piece that recompiles per bucket hits Dynamo's recompile limit at warm-up (fullgraph: a hard
failure). This builds the family's model (tiny config unless `--published`) with the shard options
given, runs `warmup()` on every rank (NCCL on CUDA, gloo on CPU) and prints per rank the compiles,
the token dims each group was marked dynamic in, and the CUDA graphs captured. Run it with
`TORCH_LOGS=recompiles` to see each recompile's reason.

    python -m benchmarks.tp.dp_warmup_probe --world-size 2 --set transforms.shard.attention=data \\
        --set transforms.shard.experts=expert --set transforms.shard.mlp=replicate
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional


def warm_rank(rank: int, family: str, sets: list[str], device: str) -> dict[str, Any]:
    from benchmarks.lib import optimize

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    om = optimize(family, overrides=[f"model.device={dev}", *sets])
    err = None
    try:
        om.warmup()
    except Exception as exc:  # noqa: BLE001 - reported with the compile stats gathered so far
        err = f"{type(exc).__name__}: {exc}"[:600]
    rep = om.report().get("startup") or {}
    return {"rank": rank, "error": err, "compile": rep.get("compile"), "capture": rep.get("capture")}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="glm_4_7_flash", help="family from model_configs/ (its tiny config)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="A.B=C")
    args = ap.parse_args(argv)
    from benchmarks.lib import spawn

    sets = ["transforms.shard.enabled=true", *args.sets] if args.world_size > 1 else list(args.sets)
    ranks = spawn(warm_rank, args.world_size, args.model, sets, args.device,
                  backend="nccl" if args.device == "cuda" else "gloo", all_results=True)
    for r in ranks:
        comp = r.get("compile") or {}
        print(f"rank {r['rank']}: error {r['error']}; compiles {comp.get('compiles')} in {comp.get('seconds')} s; "
              f"capture {json.dumps((r.get('capture') or {}).get('count'))}")
        for g in comp.get("per_group", []):
            print(f"   group {g.get('group')} pieces {g.get('pieces')}: {g.get('compiles')} compiles, dynamic "
                  f"{g.get('dynamic_sources')}, token dims {json.dumps(g.get('token_dims'))}")
    return 1 if any(r["error"] for r in ranks) else 0


if __name__ == "__main__":
    sys.exit(main())
