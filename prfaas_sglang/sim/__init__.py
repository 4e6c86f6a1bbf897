"""A discrete-event simulator (SimPy) of a PrfaaS-PD fleet that runs the product's own policy objects.

``python -m prfaas_sglang.sim --scenario case-study --json``; see ``fleet.py`` for what is simulated
and ``nodes.py`` for how each part keeps time.
"""
