"""`autodeploy build`: compile a model, print what the compiler did and why, generate, verify.

Everything that can be checked without a model is checked before any build work — the report path,
the device, the sampling flags, the whole config and pass pipeline, the runtime capacities against
this machine's memory, the prompts (token ids against the vocabulary, lengths against max_seq_len)
and the tokenizer they need — so a typo costs a second, not a build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.markup import escape

from ..api import OptimizedModel, build_config, check_runtime_capacity, optimize
from ..config.schema import DEVICE_FORMS, AppConfig, is_device_form
from ..distributed.env import env_info, is_rank0
from ..models.factory import resolve_device, vocab_size
from ..models.loading import reference_model
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


def check_device_flag(args: argparse.Namespace) -> None:
    """--device must be a form the build supports and a device this machine has — checked before
    anything is spawned or built (torch.device('tpu') raises a RuntimeError deep in the build)."""
    dev = getattr(args, "device", None)
    if dev is None:
        return
    if not is_device_form(dev):
        raise CliError(f"--device {dev!r}: not a device this build supports; expected {DEVICE_FORMS} "
                       "(N: a CUDA device index)")
    device = resolve_device(dev)  # ModelLoadError: no CUDA, or cuda:N past the device count
    world = getattr(args, "world_size", 1)
    if device.type == "cuda" and world > 1 and env_info().world_size == 1:
        count = torch.cuda.device_count()
        if world > count:
            raise CliError(f"--world-size {world} --device {dev}: one GPU per rank, but this machine has {count} "
                           f"CUDA device(s); use --world-size {count} or less")


_FIELD_VALUE = re.compile(r"^(\w+)=(\S+): (.*)$")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams, built before the build so that a bad value is refused
    in a second. SamplingParams' own checks are the rules; their messages are re-worded to name
    the flag (`--top-p 2.0: must be in (0, 1]`)."""
    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as exc:
        m = _FIELD_VALUE.match(str(exc))
        if m is None:
            raise CliError(f"sampling flags: {exc}") from None
        field, value, why = m.groups()
        raise CliError(f"--{field.replace('_', '-')} {value}: {why}") from None


def check_prompts(prompts: Sequence[Sequence[int]], sources: Sequence[str], vocab: Optional[int], max_seq_len: int,
                  max_new_tokens: int) -> None:
    """Every prompt's token ids inside the vocabulary and its length + --max-new-tokens within
    max_seq_len, before the build (the engine would refuse each request after it)."""
    for ids, src in zip(prompts, sources):
        if vocab is not None:
            for i, t in enumerate(ids):
                if not 0 <= t < vocab:
                    raise CliError(f"{src}: token id {t} at position {i} is outside the model's vocabulary: "
                                   f"vocab_size={vocab} (ids 0..{vocab - 1})")
        if len(ids) + max_new_tokens > max_seq_len:
            raise CliError(f"{src}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} = "
                           f"{len(ids) + max_new_tokens}, over runtime.max_seq_len={max_seq_len}; shorten the prompt, "
                           "lower --max-new-tokens or raise runtime.max_seq_len")


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
    """The validated config that the model flags (--model, --config, --set, --device, --dtype) name,
    its device present and its runtime capacities within this machine (still no model built)."""
    check_device_flag(args)
    sets = list(args.set)
    if args.device:
        sets.append(f"model.device={args.device}")
    if args.dtype:
        sets.append(f"model.dtype={args.dtype}")
    cfg, _ = build_config(args.model or "default", args.config, [*sets, *extra_sets])
    check_runtime_capacity(cfg.runtime, cfg.model)  # the device, metadata and caches vs this machine
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


@dataclass(frozen=True)
class CheckedInputs:
    """What `build` checked before any build work: the config, and the explicit prompts (token ids,
    then tokenized --prompt texts) with the vocabulary they were checked against."""

    cfg: AppConfig
    prompts: list[list[int]]
    vocab_size: Optional[int]


def check_inputs(args: argparse.Namespace, prompt_ids: list[list[int]], rank_sets: list[str]) -> CheckedInputs:
    """The config (with the capacity and device checks), --max-new-tokens against max_seq_len, the
    tokenizer for --prompt, and every prompt against the vocabulary and max_seq_len; no model built."""
    cfg = config_from_args(args, rank_sets)
    if args.max_new_tokens >= cfg.runtime.max_seq_len:
        raise CliError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: runtime.max_seq_len="
                       f"{cfg.runtime.max_seq_len} (prompt + generated tokens). Lower it or raise max_seq_len.")
    prompts = [list(p) for p in prompt_ids]
    sources = [f"--prompt-ids {','.join(map(str, p))}" if len(p) <= 12 else f"--prompt-ids #{i + 1} ({len(p)} ids)"
               for i, p in enumerate(prompt_ids)]
    if args.prompt:
        tokenizer = load_tokenizer(cfg)
        for text in args.prompt:
            prompts.append(list(tokenizer(text)["input_ids"]))
            sources.append(f"--prompt {text[:40]!r}")
    vocab = vocab_size(cfg.model)
    check_prompts(prompts, sources, vocab, cfg.runtime.max_seq_len, args.max_new_tokens)
    return CheckedInputs(cfg, prompts, vocab)


def build(args: argparse.Namespace) -> int:
    check_report_path(args.report)
    check_device_flag(args)
    params = sampling_params(args)
    prompt_ids = parse_prompt_ids(args.prompt_ids)
    # Outside a rank, check everything once here, before ranks are spawned or a model is built;
    # ranks (spawned, torchrun) check again with their own overrides (shard, their GPU).
    checked = check_inputs(args, prompt_ids, []) if env_info().world_size == 1 else None
    if (rc := tp.launch(args, build)) is not None:  # --world-size N: N ranks run build(); rank 0's code
        return rc
    with tp.rank_setup(args) as rank_sets:
        if checked is None or rank_sets:
            checked = check_inputs(args, prompt_ids, rank_sets)
        return _build(args, checked, params)


def _build(args: argparse.Namespace, checked: CheckedInputs, params: SamplingParams) -> int:
    console = Console(quiet=not is_rank0())
    cfg = checked.cfg
    console.print(f"[bold]autodeploy build[/] model={args.model or 'default'} device={cfg.model.device} "
                  f"dtype={cfg.model.dtype}")
    om = build_with_progress(cfg, console)
    prompts = list(checked.prompts)
    if not prompts:
        prompts = _default_prompts(om.vocab_size, cfg, args.max_new_tokens, args.seed)
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
