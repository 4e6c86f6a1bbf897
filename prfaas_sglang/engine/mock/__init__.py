"""The emulated SGLang worker (``--engine mock``): SGLang's HTTP surface and PD protocol,
profile-driven timing, a real prefix cache, real KV bytes over Mooncake TCP, and
SGLang's KV events over ZMQ. For GPU-less runs and scale tests.

Start one: ``python -m prfaas_sglang.launch --role pd-decode --engine mock --profile kimi-linear-1t-hybrid@h20x8``.
"""
