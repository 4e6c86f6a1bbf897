"""A discrete-event simulator (SimPy) of a PrfaaS-PD fleet that runs the product's own policy objects.

``python -m prfaas_sglang.sim --scenario case-study --json``; see ``fleet.py`` for what is simulated
and ``nodes.py`` for how each part keeps time; ``arrivals`` makes the arrivals and ``summary`` says
what a run comes to.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__", "summary")
