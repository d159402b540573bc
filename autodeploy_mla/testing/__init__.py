"""Test support: the product never imports this package (a layer test enforces it).

- `scenarios`: drive any cached MLA backend through multi-step schedules and compare with torch_mla;
- `tiny_configs`: the tiny random-weight configs of every family (read from model_configs/);
- `probe`: what one tensor-parallel rank saw (the spawn target of the TP tests and benchmarks).
"""

from ..verify import hf_greedy_generate  # noqa: F401
from .scenarios import STANDARD_SCHEDULES, MLASequenceData, ScenarioResult, run_scenario  # noqa: F401
