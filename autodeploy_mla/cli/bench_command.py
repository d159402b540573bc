"""`autodeploy bench`: throughput and latency of a workload, in process or against a running server.

    autodeploy bench                       # the default model, the standard workload fitted to its max_seq_len
    autodeploy bench --model deepseek_v2 --num-requests 64 --prompt-len 256:2048 --output-len 128
    autodeploy bench --url http://127.0.0.1:8000 --max-concurrency 16 --out /tmp/bench
    autodeploy bench --url http://127.0.0.1:8000 --dataset prompts.jsonl --request-rate 4
    autodeploy bench --shared-prefix 1536 --prompt-len 256 --output-len 128      # one system prompt
    autodeploy bench --multi-turn 5 --num-requests 16 --prompt-len 512 --question-len 64 --output-len 64

The standard workload is prompts of 256-2048 tokens and 128 generated tokens. A model whose
runtime.max_seq_len is shorter than 2048 + 128 (the embedded default: 128) cannot run it, so the
lengths the user leaves out are fitted to the model (`workload_lengths`) and the choice is printed;
lengths the user gives are kept, and refused before the build if they do not fit.

Prefix-sharing workloads (prefix caching): `--shared-prefix N` puts one random N-token prefix
before every prompt (`--prompt-len` is then each request's unique part); `--multi-turn T` runs
`--num-requests` conversations of T turns, turn t+1 sent when turn t finished with the prompt turn
t's prompt + its answer + a `--question-len` question (`--prompt-len`: the first turn's prompt),
and reports TTFT p50 per turn.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
import platform
import time
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..models.factory import vocab_size as config_vocab_size
from ..serving import bench
from .build_command import CliError, build_with_progress, config_from_args

#: The standard synthetic workload: prompts uniform in 256-2048 tokens, 128 generated tokens each.
STANDARD_PROMPT_LEN = (256, 2048)
STANDARD_OUTPUT_LEN = 128


@dataclass(frozen=True)
class Lengths:
    """The workload's prompt and output length ranges, and how they were chosen (None: as given)."""

    prompt: tuple[int, int]
    output: tuple[int, int]
    note: Optional[str] = None


def _parse(flag: str, text: str) -> tuple[int, int]:
    try:
        return bench.parse_range(text)
    except ValueError as exc:
        raise CliError(f"{flag} {text}: {exc}") from None


def workload_lengths(prompt_len: Optional[str], output_len: Optional[str], max_seq_len: Optional[int]) -> Lengths:
    """--prompt-len / --output-len as given; a length left out is the standard workload's (256:2048
    prompts, 128 outputs) shrunk to fit `max_seq_len` (prompt + output per request), keeping its
    shape: outputs max_seq_len // 17 (at most 128), prompts up to what is left (at most 2048) and
    down to an eighth of that. With max_seq_len >= 2176 that is the standard workload itself.
    `max_seq_len` None (a server that does not say): the standard lengths. A given length that
    leaves no room for the other is an error naming both numbers."""
    prompt = _parse("--prompt-len", prompt_len) if prompt_len is not None else None
    output = _parse("--output-len", output_len) if output_len is not None else None
    if prompt is not None and output is not None:
        return Lengths(prompt, output)
    left = " and ".join(f for f, v in (("--prompt-len", prompt_len), ("--output-len", output_len)) if v is None)
    if max_seq_len is None:
        prompt, output = prompt or STANDARD_PROMPT_LEN, output or (STANDARD_OUTPUT_LEN, STANDARD_OUTPUT_LEN)
        return Lengths(prompt, output, f"{left} not given: prompts {_fmt(prompt)}, outputs {_fmt(output)} tokens (the "
                                       "standard workload; the server does not say its max_model_len)")
    if output is None:
        longest_prompt = prompt[1] if prompt is not None else 0
        if longest_prompt >= max_seq_len:
            raise CliError(f"--prompt-len {prompt_len}: prompts of up to {longest_prompt} tokens leave no room for "
                           f"output in max_seq_len={max_seq_len}; shorten --prompt-len or raise runtime.max_seq_len")
        n = min(STANDARD_OUTPUT_LEN, max(1, max_seq_len // 17), max_seq_len - longest_prompt)
        output = (n, n)
    if prompt is None:
        hi = min(STANDARD_PROMPT_LEN[1], max_seq_len - output[1])
        if hi < 1:
            raise CliError(f"--output-len {output_len}: outputs of up to {output[1]} tokens leave no room for a prompt "
                           f"in max_seq_len={max_seq_len}; lower --output-len or raise runtime.max_seq_len")
        prompt = (max(1, hi // 8), hi)
    standard = prompt == STANDARD_PROMPT_LEN and output == (STANDARD_OUTPUT_LEN, STANDARD_OUTPUT_LEN)
    why = "the standard workload" if standard else (f"the standard {_fmt(STANDARD_PROMPT_LEN)} / {STANDARD_OUTPUT_LEN} "
                                                     f"workload fitted to max_seq_len={max_seq_len}")
    return Lengths(prompt, output, f"{left} not given: prompts {_fmt(prompt)}, outputs {_fmt(output)} tokens ({why})")


def _fmt(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


def _workload(args: argparse.Namespace, lengths: Lengths, vocab_size: int, tokenizer: Any = None) -> bench.Workload:
    try:
        if args.dataset is not None and (args.shared_prefix or args.multi_turn):
            raise CliError("--dataset reads requests from a file; --shared-prefix / --multi-turn make them: give one")
        if args.shared_prefix and args.multi_turn:
            raise CliError("--shared-prefix and --multi-turn are two workloads: give one")
        if args.shared_prefix:
            return bench.Workload.shared_prefix(args.num_requests, args.shared_prefix, lengths.prompt, lengths.output,
                                                vocab_size, args.request_rate, args.seed)
        if args.multi_turn:
            return bench.Workload.multi_turn(args.num_requests, args.multi_turn, lengths.prompt,
                                             _parse("--question-len", args.question_len), lengths.output, vocab_size,
                                             args.request_rate, args.seed)
        if args.dataset is not None:
            if not args.dataset.is_file():
                raise CliError(f"--dataset {args.dataset}: no such file")
            return bench.Workload.from_jsonl(args.dataset, tokenizer, default_max_tokens=lengths.output[1],
                                             request_rate=args.request_rate, seed=args.seed)
        return bench.Workload.synthetic(args.num_requests, lengths.prompt, lengths.output, vocab_size,
                                        args.request_rate, args.seed)
    except CliError:
        raise
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _print_choice(console: Console, args: argparse.Namespace, lengths: Lengths) -> None:
    """Say which lengths were chosen for the user (a workload nobody asked for must not look asked for)."""
    if lengths.note is None:
        return
    if args.dataset is None:
        console.print(lengths.note, soft_wrap=True)
    elif args.output_len is None:
        console.print(f"--output-len not given: requests without max_tokens in {args.dataset} generate "
                      f"{lengths.output[1]} tokens", soft_wrap=True)


def _progress(console: Console, total: int) -> Progress:
    return Progress(TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _tokenizer(path: Any) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise CliError(f"--tokenizer {path}: cannot be loaded: {exc}") from exc


def run_bench(args: argparse.Namespace) -> int:
    console = Console()
    if not args.request_rate > 0:
        raise CliError(f"--request-rate {args.request_rate}: must be > 0 requests/s (inf: all at once)")
    tokenizer = _tokenizer(args.tokenizer)
    meta: dict[str, Any] = {"command": "autodeploy bench " + " ".join(args.argv), "host": platform.node(),
                            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.url:
        card = bench.server_model_card(args.url)
        vocab = args.vocab_size or card.get("vocab_size")
        if vocab is None and args.dataset is None:
            raise CliError(f"--url {args.url}: the server does not say its vocab_size; give --vocab-size")
        max_len = int(card["max_model_len"]) if card.get("max_model_len") else None
        lengths = workload_lengths(args.prompt_len, args.output_len, max_len)
        _print_choice(console, args, lengths)
        wl = _workload(args, lengths, int(vocab or 0), tokenizer)
        if card.get("max_model_len"):
            wl.check_fits(int(card["max_model_len"]), f"the model at {args.url}")
        meta.update(mode="server", url=args.url, model=card.get("id"))
        console.print(f"[bold]autodeploy bench[/] {args.url} ({card.get('id')}): {wl.description}, "
                      f"at most {args.max_concurrency} at once")
        with _progress(console, len(wl.requests)) as prog:
            task = prog.add_task("requests", total=len(wl.requests))
            result = bench.run_against_server(args.url, wl, args.max_concurrency, card.get("id"),
                                              progress=lambda n: prog.advance(task, n))
    else:
        cfg = config_from_args(args)
        if tokenizer is None and args.dataset is not None and cfg.model.path is not None:
            tokenizer = _tokenizer(cfg.model.path) if (Path(cfg.model.path) / "tokenizer_config.json").exists() else None
        lengths = workload_lengths(args.prompt_len, args.output_len, cfg.runtime.max_seq_len)
        vocab = config_vocab_size(cfg.model)
        if vocab is not None:  # check the workload before the build when the config says the vocabulary
            _workload(args, lengths, vocab, tokenizer).check_fits(cfg.runtime.max_seq_len, "this config")
        console.print(f"[bold]autodeploy bench[/] model={args.model or 'default'} device={cfg.model.device} "
                      f"dtype={cfg.model.dtype}")
        _print_choice(console, args, lengths)
        om = build_with_progress(cfg, console)
        wl = _workload(args, lengths, om.vocab_size, tokenizer)
        wl.check_fits(om.seq_info.max_seq_len, "this config")
        meta.update(mode="in-process", model=args.model or "default", device=str(om.device), dtype=str(om.dtype),
                    backends=sorted({d.backend for d in om.ctx.artifacts.decisions}))
        if om.device.type == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(om.device)
        console.print(wl.description)
        with _progress(console, len(wl.requests)) as prog:
            task = prog.add_task("requests", total=len(wl.requests))
            result = bench.run_in_process(om, wl, progress=lambda n: prog.advance(task, n))
    result["label"] = args.label or meta["mode"]
    result["workload"] = wl.description
    for line in bench.result_table([result]):
        console.print(line, soft_wrap=True, markup=False)
    if result["failed"]:
        console.print(f"[red]{result['failed']} request(s) failed[/]: {result['errors'][0]}", soft_wrap=True)
    if args.out is not None:
        paths = bench.write_results([result], args.out, meta)
        console.print("written: " + ", ".join(str(p) for p in paths))
    return 1 if result["failed"] else 0


def add_bench_parser(sub: Any, add_model_flags: Any, positive_int: Any) -> None:
    b = sub.add_parser("bench", help="throughput and TTFT/TPOT/ITL percentiles, in process or against --url")
    add_model_flags(b)
    b.add_argument("--url", help="a running server (autodeploy serve, or any OpenAI-compatible one) instead of "
                                 "building the model here")
    b.add_argument("--num-requests", type=positive_int, default=64)
    b.add_argument("--prompt-len", help="prompt tokens: N or MIN:MAX, uniform (default 256:2048, shrunk to fit "
                                        "the model's max_seq_len)")
    b.add_argument("--output-len", help="generated tokens: N or MIN:MAX (default 128, shrunk to fit the model's "
                                        "max_seq_len)")
    b.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: "
                                                                          "all at once)")
    b.add_argument("--max-concurrency", type=positive_int, default=64, help="with --url: requests in flight at once")
    b.add_argument("--dataset", type=Path, help="JSONL: one {\"prompt_token_ids\": [...]} or {\"prompt\": \"...\"} "
                                                "per line, optional \"max_tokens\"")
    b.add_argument("--shared-prefix", type=positive_int, metavar="TOKENS",
                   help="every prompt starts with one shared random prefix of TOKENS tokens (a system prompt); "
                        "--prompt-len is each request's own part after it")
    b.add_argument("--multi-turn", type=positive_int, metavar="TURNS",
                   help="--num-requests conversations of TURNS turns: turn t+1 (sent when turn t finished) is turn "
                        "t's prompt + its answer + a new question; --prompt-len is the first turn's prompt; the report "
                        "gives TTFT p50 per turn")
    b.add_argument("--question-len", default="32", help="with --multi-turn: tokens of each later turn's question, N or "
                                                        "MIN:MAX (default 32)")
    b.add_argument("--tokenizer", help="tokenizer for text prompts in --dataset")
    b.add_argument("--vocab-size", type=positive_int, help="with --url: vocabulary for random prompts, if the server "
                                                           "does not say")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--label", help="name of this run in the table and JSON")
    b.add_argument("--out", type=Path, help="directory for bench.json and bench.png")
