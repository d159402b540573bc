"""`autodeploy`: build an MLA model through the compiler, show what it did and why, verify generation.

    autodeploy build                       # the embedded tiny DeepSeek-V3, on whatever device is here
    autodeploy build --model deepseek_v2   # a family from model_configs/ (tiny random weights)
    autodeploy build --model /ckpt --config deepseek_v3 --set runtime.page_size=32
    autodeploy serve --model deepseek_v2 --port 8000      # OpenAI-compatible server (serve extra)
    autodeploy bench --url http://127.0.0.1:8000          # TTFT/TPOT/ITL and tokens/s of a workload
    autodeploy models | backends
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from rich.console import Console

from ..config.loader import ConfigError
from ..distributed.env import DistributedError
from ..models.factory import ModelLoadError
from ..runtime.errors import CapacityError
from .bench_command import add_bench_parser, run_bench
from .build_command import CliError, build
from .serve_command import serve
from .report import list_backends, list_models


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 1")
    return v


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say which model to build and how (shared by build, serve and bench)."""
    p.add_argument("--model", help="family name from model_configs/, or an HF checkpoint directory (default: default)")
    p.add_argument("--config", action="append", default=[],
                   help="YAML file or family name layered over the model's (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override one key (repeatable)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: from config, auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autodeploy", description="MLA graph compiler: HF model -> cached inference")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="compile a model, print the report, verify generated tokens")
    add_model_flags(b)
    b.add_argument("--prompt", action="append", default=[], help="text prompt (needs a tokenizer in the checkpoint)")
    b.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=8)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's end-of-sequence token")
    b.add_argument("--report", type=Path, help="write the build report as JSON (a file path)")
    b.add_argument("--world-size", type=_positive_int, default=1,
                   help="tensor-parallel ranks, spawned here (torchrun: from its env)")
    b.add_argument("--no-verify", action="store_true", help="skip the comparison with the eager HF model")
    v = sub.add_parser("serve", help="build a model and serve it: OpenAI-compatible HTTP API (needs the serve extra)")
    add_model_flags(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    v.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the checkpoint's, if any)")
    v.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish on shutdown before they are cancelled")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    v.add_argument("--world-size", type=_positive_int, default=1,
                   help="data-parallel ranks, one engine process each (needs transforms.shard.attention=data, "
                        "experts=expert, mlp=replicate or tensor); requests go to the least-loaded rank")
    add_bench_parser(sub, add_model_flags, _positive_int)
    sub.add_parser("models", help="list the model configs in model_configs/")
    sub.add_parser("backends", help="list attention backends and whether they serve each family's dims here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.cmd in (None, "build"):
            if args.cmd is None:
                args = parser.parse_args(["build"])
            return build(args)
        if args.cmd == "serve":
            return serve(args)
        if args.cmd == "bench":
            args.argv = list(argv if argv is not None else sys.argv[1:])
            return run_bench(args)
        if args.cmd == "models":
            return list_models(console)
        if args.cmd == "backends":
            return list_backends(console)
    except (ConfigError, ModelLoadError, CapacityError, DistributedError, CliError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True)  # no line breaks inside paths and values
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
