"""Benchmarks: diagnostics (see benchmarks/README.md)."""
