"""`autodeploy bench`: throughput and latency of a workload, in process or against a running server.

    autodeploy bench --model deepseek_v2 --num-requests 64 --prompt-len 256:2048 --output-len 128
    autodeploy bench --url http://127.0.0.1:8000 --max-concurrency 16 --out /tmp/bench
    autodeploy bench --url http://127.0.0.1:8000 --dataset prompts.jsonl --request-rate 4
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..serving import bench
from .build_command import CliError, build_with_progress, config_from_args


def _workload(args: argparse.Namespace, vocab_size: int, tokenizer: Any = None) -> bench.Workload:
    try:
        if args.dataset is not None:
            if not args.dataset.is_file():
                raise CliError(f"--dataset {args.dataset}: no such file")
            return bench.Workload.from_jsonl(args.dataset, tokenizer, default_max_tokens=bench.parse_range(
                args.output_len)[1], request_rate=args.request_rate, seed=args.seed)
        return bench.Workload.synthetic(args.num_requests, bench.parse_range(args.prompt_len),
                                        bench.parse_range(args.output_len), vocab_size, args.request_rate, args.seed)
    except CliError:
        raise
    except ValueError as exc:
        raise CliError(str(exc)) from None


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
        wl = _workload(args, int(vocab or 0), tokenizer)
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
        console.print(f"[bold]autodeploy bench[/] model={args.model or 'default'} device={cfg.model.device} "
                      f"dtype={cfg.model.dtype}")
        vocab = (cfg.model.hf_config or {}).get("vocab_size")
        if vocab is not None:  # check the workload before the build when the config says the vocabulary
            _workload(args, int(vocab), tokenizer).check_fits(cfg.runtime.max_seq_len, "this config")
        om = build_with_progress(cfg, console)
        wl = _workload(args, om.vocab_size, tokenizer)
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
    b.add_argument("--prompt-len", default="256:2048", help="prompt tokens: N or MIN:MAX, uniform (default 256:2048)")
    b.add_argument("--output-len", default="128", help="generated tokens: N or MIN:MAX (default 128)")
    b.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: "
                                                                          "all at once)")
    b.add_argument("--max-concurrency", type=positive_int, default=64, help="with --url: requests in flight at once")
    b.add_argument("--dataset", type=Path, help="JSONL: one {\"prompt_token_ids\": [...]} or {\"prompt\": \"...\"} "
                                                "per line, optional \"max_tokens\"")
    b.add_argument("--tokenizer", help="tokenizer for text prompts in --dataset")
    b.add_argument("--vocab-size", type=positive_int, help="with --url: vocabulary for random prompts, if the server "
                                                           "does not say")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--label", help="name of this run in the table and JSON")
    b.add_argument("--out", type=Path, help="directory for bench.json and bench.png")
