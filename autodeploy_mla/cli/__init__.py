"""`autodeploy`: build an MLA model through the compiler, show what it did and why, verify generation.

    autodeploy build                       # the embedded tiny DeepSeek-V3, on whatever device is here
    autodeploy build --model deepseek_v2   # a family from model_configs/ (tiny random weights)
    autodeploy build --model /ckpt --config deepseek_v3 --set runtime.page_size=32
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
from .build_command import CliError, build
from .report import list_backends, list_models


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autodeploy", description="MLA graph compiler: HF model -> cached inference")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="compile a model, print the report, verify generated tokens")
    b.add_argument("--model", help="family name from model_configs/, or an HF checkpoint directory (default: default)")
    b.add_argument("--config", action="append", default=[],
                   help="YAML file or family name layered over the model's (repeatable)")
    b.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override one key (repeatable)")
    b.add_argument("--device", help="cpu | cuda | cuda:N (default: from config, auto)")
    b.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
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
