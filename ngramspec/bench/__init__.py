"""Benchmarks: corpus drafting cost and recorded token streams."""
