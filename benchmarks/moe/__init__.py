"""Benchmarks: moe (see benchmarks/README.md)."""
