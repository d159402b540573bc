"""matplotlib for the benchmark scripts, or None: the scripts run where it is not installed (the GPU
image), write their JSON and tables there, and are re-rendered (`--render`) where it is."""

from __future__ import annotations

from typing import Any, Optional


def pyplot() -> Optional[Any]:
    """`matplotlib.pyplot` on the Agg backend, or None (and a line saying so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
