"""Benchmark scripts, grouped by topic (kernels, e2e, serving, moe, tp, diagnostics), and the
library they share (`benchmarks.lib`). A package so that a script runs from the repository root
as `python -m benchmarks.<topic>.<script>` and imports `benchmarks.lib` like any module."""
