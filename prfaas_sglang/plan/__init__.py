"""Planner: the PrfaaS-PD throughput model (paper section 3.4), profiles, workloads, search.

Pure code (no I/O except ``scenario.Catalog`` reading YAML); the router (through
``prfaas_sglang.runtime``) and the emulated engine use the same objects. CLI:
``python -m prfaas_sglang.plan --help``.
"""
