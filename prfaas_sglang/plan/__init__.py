"""Planner: the PrfaaS-PD throughput model (paper section 3.4), profiles, workloads, search.

Pure code (no I/O except ``scenario.Catalog`` reading YAML, ``workload`` reading a trace and
``plots`` writing PNGs); the router (through ``prfaas_sglang.runtime``) and the emulated engine use
the same objects. CLI: ``python -m prfaas_sglang.plan --help``.

``model`` (equations (1)-(6)), ``profiles`` (what an instance costs) from ``analytic`` (rooflines,
a model config from ``hf``) or ``measured`` (``bench profile``'s files), ``anchors`` (the paper's
published values beside ours), ``workload`` (request lengths), ``search`` (threshold and PD split,
and the baselines), ``fleet`` (several PrfaaS and PD clusters, a link per pair: the LP and its joint
search), ``report`` (a plan), ``scenario`` (hardware, model, link and workload), ``plots``.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__", "plots")
