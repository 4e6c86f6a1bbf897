"""The global KV index (the paper's global KVCache manager): ``KvIndex`` (pure) fed by
SGLang KV events from every worker; ``python -m prfaas_sglang.launch --role kv-index``
(issue #5) serves it."""
