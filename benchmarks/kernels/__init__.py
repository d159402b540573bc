"""Benchmarks: kernels (see benchmarks/README.md)."""
