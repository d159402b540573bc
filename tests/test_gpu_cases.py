"""tests/gpu_cases.py stays true to the tests it describes (checked on the CPU, statically): every
`slow` pattern and every estimate names a GPU test that exists, every GPU test has an estimate, and
the default run's estimates fit its budget. A renamed or new GPU test fails here instead of silently
leaving the slow set or the budget."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import gpu_cases

TESTS = Path(__file__).resolve().parent


def _is_gpu_marked(fn: ast.FunctionDef) -> bool:
    return any("mark.gpu" in ast.unparse(d) for d in fn.decorator_list)


def gpu_tests() -> set[str]:
    """`file::name` of every test function marked `gpu` under tests/."""
    out = set()
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and _is_gpu_marked(node):
                out.add(f"{path.name}::{node.name}")
    return out


def test_every_gpu_test_has_an_estimate_and_every_entry_a_test():
    tests = gpu_tests()
    assert len(tests) > 40
    assert not tests - set(gpu_cases.ESTIMATE_S), f"GPU tests without an estimate: {sorted(tests - set(gpu_cases.ESTIMATE_S))}"
    assert not set(gpu_cases.ESTIMATE_S) - tests, f"estimates of no test: {sorted(set(gpu_cases.ESTIMATE_S) - tests)}"


def test_every_slow_pattern_names_a_gpu_test():
    tests = gpu_tests()
    stale = [p for p in gpu_cases.SLOW if not any(fnmatch.fnmatchcase(t, p.split("[")[0]) for t in tests)]
    fully_slow = [t for t, s in gpu_cases.ESTIMATE_S.items() if s == 0 and not t.startswith("test_tensor_parallel")]
    assert all(t in gpu_cases.SLOW for t in fully_slow), "an estimate of 0 s means every case is slow"
    assert not stale, f"slow patterns matching no GPU test: {stale}"


def test_the_default_run_fits_its_budget():
    assert sum(gpu_cases.ESTIMATE_S.values()) <= gpu_cases.DEFAULT_BUDGET_S
