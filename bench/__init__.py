"""Benchmarks: measured numbers side by side in one run, written to bench/results and bench/report.md."""
