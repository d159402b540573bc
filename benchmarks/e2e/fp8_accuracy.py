#!/usr/bin/env python
"""Accuracy of the FP8 (e4m3) latent cache against the model-dtype cache, per family (issue 15).

For each tiny random-weight family config, two builds that differ only in `runtime.kv_cache_dtype`
(auto = the model dtype, bf16 by default, vs fp8_e4m3), the same prompts:

- free-running greedy: 16 prompts x 32 new tokens (eos ignored); `positions identical` = the share of
  (prompt, step) positions whose token is the same in both runs (a run that diverges counts every
  later position as different), and the mean agreeing prefix;
- teacher-forced: both models prefill the reference run's full sequence (prompt + its 32 tokens, in
  chunks that read the cache) and pick at every generated position: `picks identical` and the
  relative L2 error of the logits (mean / p99 / max over positions);
- the metric's noise floor: the free-running comparison of the same family built in float32 and in
  bfloat16 (both caches in the model dtype), i.e. what plain bf16 rounding does to these random tiny
  models, whose logits are nearly flat.

    python -m benchmarks.e2e.fp8_accuracy --out docs/benchmarks            # CPU (torch reference op)
    python -m benchmarks.e2e.fp8_accuracy --device cuda --out /tmp/acc     # GPU (the resolved backends)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

FAMILIES = ("deepseek_v3", "deepseek_v2", "glm_4_7_flash", "mistral_small_4", "minicpm3")


def build(family: str, device: str, dtype: str, cache: str, prompts: int):
    from benchmarks.lib import optimize

    over = [f"model.device={device}", f"model.dtype={dtype}", f"runtime.kv_cache_dtype={cache}",
            f"runtime.max_batch_size={prompts}", "runtime.max_seq_len=160", "runtime.max_num_tokens=64",
            "runtime.page_size=16" if device == "cpu" else "runtime.page_size=64"]
    return optimize(family, overrides=over)


def measure(family: str, args: argparse.Namespace) -> dict:
    ref = build(family, args.device, args.dtype, "auto", args.prompts)
    fp8 = build(family, args.device, args.dtype, "fp8_e4m3", args.prompts)
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(8, 65, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, ref.vocab_size, (n,), generator=g).tolist() for n in lens]
    a = ref.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
    b = fp8.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    other = "float32" if args.dtype != "float32" else "bfloat16"
    c = build(family, args.device, other, "auto", args.prompts).generate(
        prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
    floor = sum(x == y for ra, rc in zip(a, c) for x, y in zip(ra, rc))
    prefix = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    picks = total = 0
    errs = []
    for p, o in zip(prompts, a):
        seq = p + o
        la, lb = ref.prefill_logits(seq).float(), fp8.prefill_logits(seq).float()
        gen = slice(len(p) - 1, len(seq) - 1)  # positions that pick the generated tokens
        la, lb = la[gen], lb[gen]
        picks += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += la.shape[0]
        errs.append((la - lb).norm(dim=-1) / la.norm(dim=-1))
    err = torch.cat(errs)
    cache_ref = ref.runner.compiled.signature.caches[0].spec
    cache_fp8 = fp8.runner.compiled.signature.caches[0].spec
    row = {
        "family": family, "backend": sorted({d.backend for d in fp8.ctx.artifacts.decisions}),
        "cache_bytes_per_token_layer": {"ref": cache_ref.bytes_per_token, "fp8": cache_fp8.bytes_per_token},
        "positions": args.prompts * args.new_tokens, "positions_identical": same / (args.prompts * args.new_tokens),
        "noise_floor_positions_identical": floor / (args.prompts * args.new_tokens), "noise_floor_vs": other,
        "mean_agreeing_prefix": sum(prefix) / len(prefix), "runs_identical": sum(x == y for x, y in zip(a, b)),
        "picks_identical": picks / total, "logit_rel_err_mean": err.mean().item(),
        "logit_rel_err_p99": err.quantile(0.99).item(), "logit_rel_err_max": err.max().item(),
    }
    print(json.dumps(row), flush=True)
    return row


def render(data: dict, out: Path) -> None:
    lines = [
        "# FP8 (e4m3) latent cache: accuracy against the model-dtype cache", "",
        f"Device: {data['device']}, model dtype {data['dtype']}, torch {data['torch']}. {data['date']}.", "",
        f"Command: `{data['command']}`", "",
        f"Tiny random-weight configs of every family (model_configs/*.yaml), {data['prompts']} prompts (8-64 tokens) x "
        f"{data['new_tokens']} greedy tokens. Reference: the same build with the cache in the model dtype. "
        "`positions identical`: free-running runs, token by token (after a divergence every later position counts "
        "as different). `picks identical` / logits error: teacher-forced on the reference tokens. `noise floor`: "
        "the same free-running comparison between the reference and a build in the other float dtype (fp32 vs "
        "bf16 model, caches in the model dtype).", "",
        "Target (issue 15): greedy tokens identical to the bf16 cache for >= 95% of positions.", "",
        "| family | backend | cache B/token/layer (ref -> fp8) | positions identical | noise floor | runs identical | "
        "mean agreeing prefix | picks identical | logits rel. err mean / p99 / max |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        c = r["cache_bytes_per_token_layer"]
        lines.append(
            f"| {r['family']} | {', '.join(r['backend'])} | {c['ref']} -> {c['fp8']} | **{100 * r['positions_identical']:.1f}%** | "
            f"{100 * r['noise_floor_positions_identical']:.1f}% ({r['noise_floor_vs']}) | "
            f"{r['runs_identical']}/{data['prompts']} | {r['mean_agreeing_prefix']:.1f} | {100 * r['picks_identical']:.1f}% | "
            f"{r['logit_rel_err_mean']:.4f} / {r['logit_rel_err_p99']:.4f} / {r['logit_rel_err_max']:.4f} |")
    allpos = sum(r["positions_identical"] * r["positions"] for r in data["rows"]) / sum(r["positions"] for r in data["rows"])
    picks = sum(r["picks_identical"] for r in data["rows"]) / len(data["rows"])
    floor = sum(r["noise_floor_positions_identical"] for r in data["rows"]) / len(data["rows"])
    lines += ["", f"All families: {100 * allpos:.1f}% of positions identical free-running (noise floor {100 * floor:.1f}%), "
              f"{100 * picks:.1f}% of teacher-forced picks identical."]
    if data.get("notes"):
        lines += ["", data["notes"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_accuracy.md").write_text("\n".join(lines) + "\n")
    (out / "fp8_accuracy.json").write_text(json.dumps(data, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--notes", default="")
    args = ap.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        data["notes"] = args.notes or data.get("notes", "")
        render(data, args.out)
        return
    data = {"device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or 'x86'})",
            "dtype": args.dtype, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "command": "python -m benchmarks.e2e.fp8_accuracy " + " ".join(sys.argv[1:]), "prompts": args.prompts,
            "new_tokens": args.new_tokens, "notes": args.notes,
            "rows": [measure(f, args) for f in args.families.split(",")]}
    render(data, args.out)


if __name__ == "__main__":
    main()
