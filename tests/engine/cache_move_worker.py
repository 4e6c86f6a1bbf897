"""One SGLang prefill worker's cache-move side on CPU, as a process (tests/engine/test_cache_move_sglang.py).

Real: SGLang's pools and prefix cache (0.5.15: our state-reporting ``MambaRadixCache``, or SGLang's
own ``RadixCache`` for a full-attention model; 0.5.23: its unified tree, ours or SGLang's own), SGLang's Mooncake transfer engine over TCP, the agent
started by the ``cache-move-agent`` hook function, its steps run by the ``cache-move-steps`` hook
function from a loop standing in for the scheduler's, the routes ``install_routes`` adds (the
``cache-move-routes`` hook's) on a FastAPI app behind SGLang's own ``--api-key`` middleware,
served by uvicorn. What is stubbed: the scheduler object (a namespace with the attributes the hooks
read) and the model (a source's prefix gets seeded KV and state instead of a forward pass).

Environment: PROBE_PORT (HTTP), PROBE_IPC_DIR, PROBE_MODEL (hybrid | full), PROBE_SEED_PREFIXES (JSON
list of token lists the worker caches at start, each with KV and state from PROBE_SEED), PRFAAS_ROLE,
PRFAAS_SECRET_FILE (optional). ``POST /probe/held {"tokens": [...]}`` answers what this worker would
reuse of them and a digest of those tokens' KV rows and state, plus its pool accounting.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import types

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402

from prfaas_sglang.plugin import register  # noqa: E402

register()  # as in every SGLang server process; raises if a hook fails

from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    get_mooncake_transfer_engine,
    init_mooncake_transfer_engine,
)
from sglang.srt.utils.auth import add_api_key_middleware  # noqa: E402

from prfaas_sglang.bench.sglang_cpu import (  # noqa: E402
    cpu_full_cache,
    cpu_prefill_hybrid_cache,
    random_prefix_transfer,
)
from prfaas_sglang.hooks.cache_import import export_prefix, import_prefix, usable_prefix_tokens  # noqa: E402
from prfaas_sglang.hooks.cache_move_hook import install_routes, run_steps, start_agent  # noqa: E402
from prfaas_sglang.security import load_keys  # noqa: E402

KV_TOKENS, STATE_SLOTS = 256, 8
PORT = int(os.environ["PROBE_PORT"])
MODEL = os.environ.get("PROBE_MODEL", "hybrid")
AGENT: list = []  # the started agent


def build():
    """The installed SGLang's tree (0.5.15's per-kind caches or 0.5.23's unified tree), as a server builds it."""
    if MODEL == "full":
        return cpu_full_cache(4, KV_TOKENS, events=False, kv_buffers=True)
    return cpu_prefill_hybrid_cache(1, KV_TOKENS, STATE_SLOTS, events=False)


def seed(built, tokens: list[int], gen: torch.Generator) -> None:
    """Cache ``tokens`` with random KV rows and state, as a finished prefill leaves them: through the
    release's own insert, by way of ``import_prefix`` (which tests check against the buffers)."""
    import_prefix(built.cache, random_prefix_transfer(built.cache, tokens, gen))


def held(built, tokens: list[int]) -> dict:
    """What this worker would reuse of ``tokens``, a digest of those tokens' KV rows and state, and
    its pool accounting."""
    digest = hashlib.sha256()
    transfer = export_prefix(built.cache, tokens)
    for blob in (transfer.kv + transfer.state) if transfer is not None else []:
        digest.update(blob.data)
    size = built.cache.total_size()
    sizes = size if isinstance(size, tuple) else (size,)
    out = {"held": usable_prefix_tokens(built.cache, tokens), "digest": digest.hexdigest(), "total": KV_TOKENS,
           "free_plus_cached": built.kv.available_size() + sizes[0]}
    if AGENT:
        out["quarantined_bytes"] = AGENT[0].quarantined_bytes
    if MODEL != "full":
        out["state_free_plus_cached"] = built.req_pool.mamba_allocator.available_size() + sizes[1]
        out["state_total"] = STATE_SLOTS
    return out


def main() -> None:
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    built = build()
    gen = torch.Generator().manual_seed(int(os.environ.get("PROBE_SEED", "0")))
    for tokens in json.loads(os.environ.get("PROBE_SEED_PREFIXES", "[]")):
        seed(built, tokens, gen)
    keys = load_keys()
    server_args = types.SimpleNamespace(
        disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake_tcp", tp_size=1, pp_size=1,
        dp_size=1, api_key=keys.worker_api_key if keys else None)
    port_args = types.SimpleNamespace(scheduler_input_ipc_name=f"ipc://{os.environ['PROBE_IPC_DIR']}/scheduler-{PORT}")
    scheduler = types.SimpleNamespace(
        tree_cache=built.cache,
        disagg_prefill_bootstrap_queue=types.SimpleNamespace(kv_manager=types.SimpleNamespace(engine=get_mooncake_transfer_engine())))
    start_agent(None, scheduler, server_args, port_args)
    agent = scheduler.prfaas_cache_move
    AGENT.append(agent)

    def scheduler_loop() -> None:  # the scheduler's event loop, as far as the hook sees it
        while True:
            run_steps(None, scheduler, [])
            time.sleep(0.002)

    threading.Thread(target=scheduler_loop, daemon=True).start()

    app = FastAPI()
    install_routes(app, server_args, port_args, os.environ.get("PRFAAS_ROLE"), keys)

    @app.post("/probe/held")
    async def probe_held(request: Request):
        tokens = (await request.json())["tokens"]
        return agent.steps.call(lambda: held(built, tokens), 10.0)

    if keys is not None:
        add_api_key_middleware(app, api_key=keys.worker_api_key, admin_api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")


if __name__ == "__main__":
    main()
