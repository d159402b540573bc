"""`autodeploy build`: compile a model, print what the compiler did and why, generate, verify.

Everything that can be checked without a model is checked before any build work — the report path,
the prompts and the tokenizer they need, max_new_tokens against max_seq_len, the whole config and
pass pipeline — so a typo costs a second, not a build.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Optional

import torch
from rich.console import Console
from rich.markup import escape

from ..api import OptimizedModel, build_config, check_runtime_capacity, optimize
from ..config.schema import AppConfig
from ..distributed.env import is_rank0
from ..models.skeleton import reference_model
from ..runtime.sampling import SamplingParams
from ..verify import compare_greedy
from . import tp
from .report import print_report


class CliError(ValueError):
    """A command-line argument that cannot work; the message says why and what to do."""


def check_report_path(path: Optional[Path]) -> None:
    """The report path must name a file we can write (before the build, not after it)."""
    if path is None:
        return
    if path.is_dir():
        raise CliError(f"--report {path}: is a directory; give a file path such as {path / 'report.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise CliError(f"--report {path}: cannot create it ({existing} is not a writable directory)")
    if path.exists() and not os.access(path, os.W_OK):
        raise CliError(f"--report {path}: the file exists and is not writable")


def parse_prompt_ids(items: list[str]) -> list[list[int]]:
    prompts = []
    for s in items:
        try:
            ids = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise CliError(f"--prompt-ids {s!r}: expected comma-separated integers such as 1,2,3") from None
        if not ids:
            raise CliError(f"--prompt-ids {s!r}: no token ids")
        prompts.append(ids)
    return prompts


def load_tokenizer(cfg: AppConfig) -> Any:
    """The checkpoint's tokenizer, for --prompt text (an error naming the problem otherwise)."""
    path = cfg.model.path
    if path is None:
        raise CliError("--prompt (text) needs a checkpoint with a tokenizer; use --prompt-ids for random-weight models")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise CliError(f"--prompt: no tokenizer could be loaded from {path}: {exc}") from exc


def _default_prompts(vocab: int, cfg: AppConfig, max_new: int, seed: int) -> list[list[int]]:
    """Four seeded prompts of different lengths, long enough to cross pages and chunks."""
    g = torch.Generator().manual_seed(seed)
    rt = cfg.runtime
    lengths = [max(1, min(n, rt.max_seq_len - max_new)) for n in (3, 17, rt.max_num_tokens + 5, 40)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def config_from_args(args: argparse.Namespace, extra_sets: Sequence[str] = ()) -> AppConfig:
    """The validated config that the model flags (--model, --config, --set, --device, --dtype) name."""
    sets = list(args.set)
    if args.device:
        sets.append(f"model.device={args.device}")
    if args.dtype:
        sets.append(f"model.dtype={args.dtype}")
    cfg, _ = build_config(args.model or "default", args.config, [*sets, *extra_sets])
    check_runtime_capacity(cfg.runtime)
    return cfg


def build_with_progress(cfg: AppConfig, console: Console) -> OptimizedModel:
    """optimize() with one line per pass and a spinner, then warm-up (compiles, CUDA graphs), then where
    the start-up time went (`OptimizedModel.startup()`: load, passes, compile, capture, warm-up, caches)."""
    with console.status("building...") as status:
        def on_pass(rec):
            mark = "[green]✓[/]" if rec.enabled else "[dim]-[/]"
            console.print(f"  {mark} {rec.name:<30} {rec.seconds:7.2f}s  {rec.summary}")
            status.update(f"pass {rec.name} done")

        om = optimize(None, cfg, on_pass=on_pass)
    with console.status("warming up (compiling static pieces, capturing CUDA graphs)..."):
        om.warmup()
    for line in om.startup().lines():
        console.print(f"  [dim]startup[/] {escape(line)}", highlight=False)
    return om


def build(args: argparse.Namespace) -> int:
    check_report_path(args.report)
    prompt_ids = parse_prompt_ids(args.prompt_ids)
    if (rc := tp.launch(args, build)) is not None:  # --world-size N: N ranks run build(); rank 0's code
        return rc
    with tp.rank_setup(args) as rank_sets:
        return _build(args, prompt_ids, rank_sets)


def _build(args: argparse.Namespace, prompt_ids: list[list[int]], rank_sets: list[str]) -> int:
    console = Console(quiet=not is_rank0())
    cfg = config_from_args(args, rank_sets)
    if args.max_new_tokens >= cfg.runtime.max_seq_len:
        raise CliError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: runtime.max_seq_len="
                       f"{cfg.runtime.max_seq_len} (prompt + generated tokens). Lower it or raise max_seq_len.")
    tokenizer = load_tokenizer(cfg) if args.prompt else None
    console.print(f"[bold]autodeploy build[/] model={args.model or 'default'} device={cfg.model.device} "
                  f"dtype={cfg.model.dtype}")
    om = build_with_progress(cfg, console)
    prompts = list(prompt_ids)
    if tokenizer is not None:
        prompts += [tokenizer(p)["input_ids"] for p in args.prompt]
    if not prompts:
        prompts = _default_prompts(om.vocab_size, cfg, args.max_new_tokens, args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    with console.status("generating..."):
        reqs = om.generate_requests(prompts, params)
    outs = [r.generated for r in reqs]
    errors = [r.error for r in reqs if r.error]
    verification = None
    if not args.no_verify and args.temperature == 0 and is_rank0() and not errors:
        with console.status("verifying against the eager HF model..."):
            ref = reference_model(om.eager_model, cfg.model, om.device, om.dtype)
            verification = compare_greedy(ref, prompts, outs, args.max_new_tokens, exact=om.dtype == torch.float32,
                                          ignore_eos=args.ignore_eos)
    report = om.report()
    report["verification"] = verification
    print_report(console, report, prompts, outs)
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
