"""Engine-side code: what runs inside (or instead of) an SGLang server.

``mock/`` is the emulated SGLang worker (``--engine mock``); ``blocks`` and
``kv_events`` are SGLang's block-hash and KV-event wire formats, shared by the
mock and (later) the kv-index.
"""
