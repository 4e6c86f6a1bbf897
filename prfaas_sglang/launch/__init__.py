"""Launcher: the command each node of a topology runs (``command``) and the CLI that execs it.

``python -m prfaas_sglang.launch --help``. Roles and topology files live in
:mod:`prfaas_sglang.roles` and :mod:`prfaas_sglang.topology`; building a command
is pure and importable without SGLang.
"""
