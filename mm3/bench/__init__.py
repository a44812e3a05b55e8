"""Benchmarks of this engine: `python -m mm3 bench` (every stage against the diffusers reference on
the same random weights, `cli`) and `python -m mm3.bench.dequant` (dequantization throughput
against gguf-py). `reference` drives the diffusers reference for the benchmark and the tests."""

from .cli import add_cli, main, run

__all__ = ["add_cli", "main", "run"]
