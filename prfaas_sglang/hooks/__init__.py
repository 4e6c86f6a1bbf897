"""Runtime hooks installed into SGLang by :mod:`prfaas_sglang.plugin`.

Each module here is an adapter: it receives SGLang objects and calls pure
logic elsewhere in the package. Modules import sglang lazily (inside functions)
so that importing them never pulls SGLang in.
"""
