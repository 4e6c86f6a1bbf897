"""The global KV index (the paper's global KVCache manager): ``KvIndex`` (pure) fed by
SGLang KV events from every worker; ``python -m prfaas_sglang.launch --role kv-index``
serves it (``__main__``); ``feed`` turns a worker's ZMQ frames into index updates. ``admission``
decides which prefills a PrfaaS worker's tree keeps (pure), ``admission_env`` reads its settings
from the environment (for SGLang's cache backend and the emulated engine alike)."""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__",)
