"""Benchmarks: serving (see benchmarks/README.md)."""
