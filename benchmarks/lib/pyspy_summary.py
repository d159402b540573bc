"""Summaries of py-spy `--format raw --threads` profiles (collapsed stacks, one line per stack:
`thread (TID): NAME;frame;frame;... COUNT`), as markdown: per thread, its samples, the functions
holding the most samples (self), and those on the stack the most (inclusive).

    python -m benchmarks.lib.pyspy_summary PROFILE.raw [--top 15]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<fn>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines merged, paths shortened."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m['fn']} ({Path(m['file']).name})"


def parse(path: Path) -> dict[str, dict[str, Any]]:
    """thread name -> {"samples", "self": Counter, "incl": Counter} from one raw profile."""
    threads: dict[str, dict[str, Any]] = defaultdict(lambda: {"samples": 0, "self": Counter(), "incl": Counter()})
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        head, _, rest = stack.partition(";")
        name = head.split(": ", 1)[1] if ": " in head else head  # "thread (TID): NAME" -> NAME
        frames = [_short(f) for f in rest.split(";") if f] if rest else []
        t = threads[name]
        t["samples"] += n
        if frames:
            t["self"][frames[-1]] += n
            for f in set(frames):
                t["incl"][f] += n
    return dict(threads)


def markdown(path: Path, top: int = 15, rate_hz: float = 100.0) -> list[str]:
    threads = parse(path)
    total = sum(t["samples"] for t in threads.values())
    out = [f"Profile `{Path(path).name}`: {total} samples ({total / rate_hz:.1f} s of thread time at {rate_hz:g} Hz).", ""]
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        if t["samples"] < max(1, total // 100):
            continue
        out += [f"### thread `{name}`: {t['samples']} samples ({100 * t['samples'] / max(total, 1):.0f}%)", "",
                "| self | % | inclusive | % |", "|---|---:|---|---:|"]
        selfs = t["self"].most_common(top)
        incls = t["incl"].most_common(top)
        for i in range(max(len(selfs), len(incls))):
            a = selfs[i] if i < len(selfs) else ("", 0)
            b = incls[i] if i < len(incls) else ("", 0)
            pa = f"{100 * a[1] / t['samples']:.1f}" if a[1] else ""
            pb = f"{100 * b[1] / t['samples']:.1f}" if b[1] else ""
            out.append(f"| `{a[0]}` | {pa} | `{b[0]}` | {pb} |")
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--rate", type=float, default=100.0, help="the sampling rate py-spy ran at (Hz)")
    args = ap.parse_args()
    for p in args.profile:
        print("\n".join(markdown(p, args.top, args.rate)))


if __name__ == "__main__":
    main()
