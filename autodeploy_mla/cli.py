"""`autodeploy`: build an MLA model through the compiler, show what it did and why, verify generation.

    autodeploy build                       # the embedded tiny DeepSeek-V3, on whatever device is here
    autodeploy build --model deepseek_v2   # a family from model_configs/ (tiny random weights)
    autodeploy build --model /ckpt --config model_configs/deepseek_v3.yaml --set runtime.page_size=32
    autodeploy models | backends
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.table import Table

from .config.loader import ConfigError, load_config
from .custom_ops.backend_registry import DeviceInfo, all_backends, library_versions
from .custom_ops.mla_dims import MLADims
from .models.factory import ModelLoadError, available_model_configs, model_config_path, resolve_model_arg

console = Console()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autodeploy", description="MLA graph compiler: HF model -> cached inference")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="compile a model, print the report, verify generated tokens")
    b.add_argument("--model", help="family name from model_configs/, or an HF checkpoint directory (default: default)")
    b.add_argument("--config", action="append", default=[], help="YAML layered over the model's (repeatable)")
    b.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override one key (repeatable)")
    b.add_argument("--device", help="cpu | cuda | cuda:N (default: from config, auto)")
    b.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    b.add_argument("--prompt", action="append", default=[], help="text prompt (needs a tokenizer in the checkpoint)")
    b.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    b.add_argument("--max-new-tokens", type=int, default=8)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--report", type=Path, help="write the build report as JSON")
    b.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks, spawned here (torchrun: from its env)")
    b.add_argument("--no-verify", action="store_true", help="skip the comparison with the eager HF model")
    sub.add_parser("models", help="list the model configs in model_configs/")
    sub.add_parser("backends", help="list attention backends and whether they serve the DeepSeek dims here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd in (None, "build"):
            if args.cmd is None:
                args = _parser().parse_args(["build"])
            return build(args)
        if args.cmd == "models":
            for name in available_model_configs():
                first = next((ln for ln in model_config_path(name).read_text().splitlines() if ln.startswith("#")), "")
                console.print(f"[bold]{name}[/]  {first.lstrip('# ')}")
            return 0
        if args.cmd == "backends":
            return backends()
    except (ConfigError, ModelLoadError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    return 0


def backends() -> int:
    dev = DeviceInfo.of("cuda" if torch.cuda.is_available() else "cpu")
    versions = library_versions()
    t = Table(title=f"MLA backends on {dev.short()} ({', '.join(f'{k} {v}' for k, v in versions.items())})")
    for col in ("backend", "DeepSeek N128 512/64 bf16", "MiniCPM3 N40 256/32 bf16"):
        t.add_column(col)
    for name, be in all_backends().items():
        cells = []
        for dims in (MLADims(128, 128, 64, 128, 512), MLADims(40, 64, 32, 64, 256)):
            r = be.check(dims, torch.bfloat16, dev, versions, 64)
            cells.append(("[green]yes[/] " if r.ok else "[red]no[/] ") + r.reason)
        t.add_row(name, *cells)
    console.print(t)
    return 0


def _layers(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """Config layers in order: model YAML, --config YAMLs, then a checkpoint dir; and --set overrides."""
    model_layer = resolve_model_arg(args.model or "default")
    layers: list[Any] = []
    if not isinstance(model_layer, dict):
        layers.append(model_layer)
    layers += [Path(c) for c in args.config]
    if isinstance(model_layer, dict):  # checkpoint path wins over any hf_config in the YAMLs
        layers.append(model_layer)
    sets = list(args.set)
    if args.device:
        sets.append(f"model.device={args.device}")
    if args.dtype:
        sets.append(f"model.dtype={args.dtype}")
    return layers, sets


def _prompts(args: argparse.Namespace, om: Any) -> list[list[int]]:
    prompts = [[int(x) for x in s.split(",") if x.strip()] for s in args.prompt_ids]
    if args.prompt:
        path = om.config.model.path
        if path is None:
            raise ValueError("--prompt (text) needs a checkpoint with a tokenizer; use --prompt-ids for random-weight models")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise ValueError(f"--prompt: no tokenizer could be loaded from {path}: {exc}") from exc
        prompts += [tok(p)["input_ids"] for p in args.prompt]
    if not prompts:  # four seeded prompts of different lengths, long enough to cross pages and chunks
        vocab = om.eager_model.config.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        rt = om.config.runtime
        lengths = [max(1, min(n, rt.max_seq_len - args.max_new_tokens)) for n in (3, 17, rt.max_num_tokens + 5, 40)]
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return prompts


def _verify(om: Any, prompts: list[list[int]], outs: list[list[int]], max_new: int) -> dict[str, Any]:
    """Greedy tokens of the eager HF model vs ours: identical in fp32; in 16-bit, agreement is reported."""
    from .distributed.launch import reference_model
    from .testing import hf_greedy_generate

    per, model = [], reference_model(om)
    for p, o in zip(prompts, outs):
        ref = hf_greedy_generate(model, p, max_new)
        agree = next((i for i, (a, b) in enumerate(zip(ref, o)) if a != b), min(len(ref), len(o)))
        per.append({"prompt_len": len(p), "ours": o, "hf": ref, "identical": ref == o, "agreeing_prefix": agree})
    exact = om.dtype == torch.float32
    ok = all(x["identical"] for x in per) if exact else all(x["agreeing_prefix"] >= 1 for x in per)
    return {"ok": ok, "criterion": "identical greedy tokens (fp32)" if exact else
            "first token identical; 16-bit rounding may diverge later", "prompts": per}


def build(args: argparse.Namespace) -> int:
    from .distributed.launch import cli_launch, cli_setup

    if (rc := cli_launch(args, build)) is not None:  # --world-size N: N ranks run build(); rank 0's code
        return rc
    from .distributed.env import env_info, shutdown_distributed

    # Under torchrun this process starts the group itself, so it also tears it down (spawned ranks
    # find it started and leave that to the launcher).
    owns_group = env_info().world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        return _build(args, cli_setup(args, console))  # in a rank: process group, shard pass on, own GPU
    finally:
        if owns_group:
            shutdown_distributed()


def _build(args: argparse.Namespace, rank_sets: list[str]) -> int:
    from .api import optimize
    from .distributed.launch import is_rank0

    layers, sets = _layers(args)
    sets += rank_sets
    cfg = load_config(*layers, overrides=sets)
    if args.prompt and cfg.model.path is None:  # fail before a long build, not after it
        raise ValueError("--prompt (text) needs a checkpoint with a tokenizer; use --prompt-ids for random-weight models")
    console.print(f"[bold]autodeploy build[/] model={args.model or 'default'} device={cfg.model.device} dtype={cfg.model.dtype}")
    with console.status("building...") as status:
        def on_pass(rec):
            mark = "[green]✓[/]" if rec.enabled else "[dim]-[/]"
            console.print(f"  {mark} {rec.name:<30} {rec.seconds:7.2f}s  {rec.summary}")
            status.update(f"pass {rec.name} done")

        om = optimize(None, cfg, on_pass=on_pass)
    prompts = _prompts(args, om)
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    with console.status("generating..."):
        reqs = om.generate_requests(prompts, _sampling(args.max_new_tokens, sampling))
    outs = [r.generated for r in reqs]
    errors = [r.error for r in reqs if r.error]
    verification = None
    if not args.no_verify and args.temperature == 0 and is_rank0():
        with console.status("verifying against the eager HF model..."):
            verification = _verify(om, prompts, outs, args.max_new_tokens)
    report = om.report()
    report["verification"] = verification
    _print_report(report, prompts, outs)
    if args.report and is_rank0():
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2, default=str))
        console.print(f"report written to {args.report}")
    if errors:
        console.print(f"[red]{len(errors)} request(s) failed:[/] {errors[0]}")
        return 1
    if verification is not None:
        if not verification["ok"]:
            console.print(f"[red]verification FAILED[/] ({verification['criterion']})")
            return 1
        console.print(f"[green]verification passed[/]: {verification['criterion']}, {len(prompts)} prompts")
    return 0


def _sampling(max_new: int, kw: dict[str, Any]):
    from .runtime.sampling import SamplingParams

    return SamplingParams(max_new_tokens=max_new, **kw)


def _print_report(report: dict[str, Any], prompts: list[list[int]], outs: list[list[int]]) -> None:
    t = Table(title="MLA layers: backend per node")
    for col in ("layer", "dims", "backend", "why", "rejected"):
        t.add_column(col, overflow="fold")
    for lay in report["layers"]:
        d = lay["dims"]
        dims = f"N{d['num_heads']} R{d['kv_lora_rank']} Dr{d['qk_rope_head_dim']} Dn{d['qk_nope_head_dim']} Dv{d['v_head_dim']}"
        rej = "; ".join(f"{r['backend']}: {r['reason']}" for r in lay["rejected"]) or "-"
        t.add_row(lay["layer"], dims, lay["backend"], lay["reason"], rej)
    console.print(t)
    c = report["cache"]
    console.print(
        f"cache: {c['layers']} layers x {c['num_pages']} pages x {c['page_size']} tokens "
        f"= {c['total_bytes'] / 2**20:.2f} MiB ({report['dtype']}, {report['device']})"
    )
    t = Table(title="passes")
    for col in ("pass", "seconds", "summary"):
        t.add_column(col)
    for p in report["passes"]:
        t.add_row(p["name"], f"{p['seconds']:.3f}" if p["enabled"] else "off", p["summary"])
    console.print(t)
    g = report["generation"]
    t = Table(title=f"generation: {g['generated_tokens']} tokens in {g['steps']} steps, {g['tokens_per_s']:.1f} tokens/s")
    for col in ("prompt len", "generated", "HF eager"):
        t.add_column(col, overflow="fold")
    ver = (report.get("verification") or {}).get("prompts") or [{}] * len(prompts)
    for p, o, v in zip(prompts, outs, ver):
        hf = v.get("hf")
        t.add_row(str(len(p)), " ".join(map(str, o)), "-" if hf is None else ("same" if v["identical"] else " ".join(map(str, hf))))
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
