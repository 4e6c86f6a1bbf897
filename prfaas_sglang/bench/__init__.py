"""Benchmarks whose numbers go into BENCHMARKS.md: ``python -m prfaas_sglang.bench --help``."""
