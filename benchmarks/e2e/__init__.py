"""Benchmarks: e2e (see benchmarks/README.md)."""
