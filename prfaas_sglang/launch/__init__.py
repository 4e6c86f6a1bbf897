"""Launcher: the command each node of a topology runs (``command``) and the CLI that execs it.

``supervisor`` is the role supervisor of a ``role_switch: restart`` node; ``k8s`` the Kubernetes
manifests and ``grafana`` the Grafana dashboard of ``--emit k8s`` (both pure); ``images`` builds and checks
the images of ``docker/`` (``make images``).

``python -m prfaas_sglang.launch --help``. Roles and topology files live in
:mod:`prfaas_sglang.roles` and :mod:`prfaas_sglang.topology`; building a command
is pure and importable without SGLang.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__", "supervisor", "images")
