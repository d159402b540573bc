"""What every result file records about its run: the machine, the versions, the command; and
errors shortened to one line so a failed row still fits a table."""

from __future__ import annotations

import datetime
import platform
import sys

import torch


def error_line(e: Exception) -> str:
    """`Type: first line of the message` (160 characters at most)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def command(argv=None) -> str:
    """The command line that reproduces this run: `python -m <script module> <args>`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = f"-m {spec.name}" if spec is not None else sys.argv[0]
    return " ".join(["python", target, *(sys.argv[1:] if argv is None else argv)])


def machine(cmd: str) -> dict:
    """GPU, versions (torch, Triton, FlashInfer, Python), UTC date and `cmd`."""
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": v("triton"), "flashinfer": v("flashinfer-python"),
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": cmd}

