"""Launcher: roles, topology files, and the SGLang command each role runs.

``python -m prfaas_sglang.launch --help``. The pure parts (roles, topology,
plan) are importable without SGLang.
"""
