"""Benchmarks: tp (see benchmarks/README.md)."""
