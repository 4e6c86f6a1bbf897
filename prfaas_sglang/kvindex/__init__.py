"""The global KV index (the paper's global KVCache manager): ``KvIndex`` (pure) fed by
SGLang KV events from every worker; ``python -m prfaas_sglang.launch --role kv-index``
serves it (``__main__``); ``feed`` turns a worker's ZMQ frames into index updates."""
