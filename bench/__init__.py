"""Benchmarks, run from the repository root as modules (``python -m bench.checkpoint``); each prints
ratios measured side by side in one run. They import product code and ``tests.support``, never a test."""
