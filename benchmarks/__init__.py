"""The benchmarks: run each from the repository root as ``python -m benchmarks.NAME``
(benchmarks/RESULTS.md has what each one measured); benchmarks/_common.py is their harness."""
