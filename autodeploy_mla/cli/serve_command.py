"""`autodeploy serve`: build a model and serve it over an OpenAI-compatible HTTP API.

The same model flags as `build`; the server listens on --host (default 127.0.0.1: only this
machine) and --port (default 8000). Needs the `serve` extra (FastAPI, uvicorn, prometheus-client).
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Any, Optional

from rich.console import Console

from ..config.schema import AppConfig
from .build_command import CliError, config_from_args


def _serving_module() -> Any:
    try:
        from ..serving import server
    except ImportError as exc:
        raise CliError(f"`autodeploy serve` needs the serve extra ({exc.name} is missing): "
                       "pip install 'autodeploy-mla[serve]'") from None
    return server


def check_port(host: str, port: int) -> None:
    """Fail before the build (minutes) rather than after it if the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise CliError(f"--port {port}: must be in 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CliError(f"--host {host!r}: cannot be resolved ({exc})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise CliError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); "
                           "pick another --port") from None


def load_serving_tokenizer(cfg: AppConfig, path: Optional[str], console: Console) -> Any:
    """--tokenizer, else the checkpoint's tokenizer, else none (prompts as token ids only)."""
    src = path or cfg.model.path
    if src is None:
        console.print("[yellow]no tokenizer[/] (random-weight model): prompts must be token ids; "
                      "ask for \"return_token_ids\": true to get ids back")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src)
    except Exception as exc:
        if path is not None:
            raise CliError(f"--tokenizer {path}: cannot be loaded: {exc}") from exc
        console.print(f"[yellow]no tokenizer in {src}[/] ({type(exc).__name__}): prompts must be token ids")
        return None


def engine_cores(args: argparse.Namespace, cfg: AppConfig, serving: Any) -> Any:
    """One engine-core process, or one per data-parallel rank (`--world-size N`), its layout
    (data-parallel attention) checked before any process starts. One GPU per rank: `--device cuda`
    is checked with the other flags (`check_device_flag`); a device the config names fails in the
    rank's process-group start, before its build."""
    world = getattr(args, "world_size", 1)
    if world == 1:
        return serving.ProcessCore(cfg)
    try:
        configs = serving.data_parallel_configs(cfg, world)
    except ValueError as exc:
        raise CliError(f"--world-size {world}: {exc}") from None
    return serving.RankedCores(configs)


def serve(args: argparse.Namespace) -> int:
    """Check everything that needs no model, start the HTTP server at once (GET /health answers 503
    "starting" while the engine-core process builds and warms up the model, then 200), serve until
    Ctrl-C, drain. Exit code 1 if the engine core failed."""
    console = Console()
    serving = _serving_module()
    check_port(args.host, args.port)
    if args.drain_timeout < 0:
        raise CliError(f"--drain-timeout {args.drain_timeout}: must be >= 0 seconds")
    cfg = config_from_args(args)
    tokenizer = load_serving_tokenizer(cfg, args.tokenizer, console)
    name = args.served_model_name or (cfg.model.path or args.model or "default")
    console.print(f"[bold]autodeploy serve[/] model={name} device={cfg.model.device} dtype={cfg.model.dtype}")
    t0 = time.perf_counter()

    def progress(message: str) -> None:
        console.print(f"  [dim]{time.perf_counter() - t0:6.1f}s[/] {message}", soft_wrap=True)

    server = serving.Server(engine_cores(args, cfg, serving), tokenizer, str(name),
                            drain_timeout_s=args.drain_timeout, on_progress=progress)
    server.on_ready = lambda info: console.print(
        f"[green]ready[/] after {time.perf_counter() - t0:.1f} s: serving [bold]{name}[/] on "
        f"http://{args.host}:{args.port}/v1 (Ctrl-C stops: running requests get {args.drain_timeout:g} s to finish)\n"
        f"  start-up: {format_startup(info.startup)}", soft_wrap=True)
    console.print(f"listening on http://{args.host}:{args.port} (GET /health answers 503 until the model is ready)")
    try:
        serving.UvicornServer(server, args.host, args.port, log_level=args.log_level).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    if server.exit_code:
        console.print(f"[red]server stopped: the engine failed[/] ({server.client.error})", soft_wrap=True)
        return server.exit_code
    console.print("server stopped")
    return 0


def format_startup(startup: dict[str, Any]) -> str:
    """One line of start-up phases: `load 3.1 s, passes 12.0 s, ...` (seconds values only)."""
    parts = [f"{k.removesuffix('_s')} {v:.1f} s" for k, v in startup.items()
             if k.endswith("_s") and isinstance(v, (int, float))]
    return ", ".join(parts) or "-"
