"""SGLang plugin entry point: the only place runtime hooks are installed.

SGLang loads ``prfaas_sglang.plugin:register`` through the ``sglang.srt.plugins``
entry-point group in ``launch_server``, ``sglang serve``, ``Engine`` and every
scheduler subprocess (``sglang/srt/plugins/__init__.py``).

Upstream catches and *logs* both a plugin that raises and a hook that fails to
apply, then carries on with stock behaviour. We do not accept that: a
PrfaaS server running without its hooks is silently wrong. So ``register()``

1. checks the installed SGLang is the pinned release with every patch of ``patches/series`` applied,
2. registers every hook in :data:`HOOKS` with SGLang's ``HookRegistry``,
3. applies them immediately (``HookRegistry.apply_hooks`` is idempotent per
   target, so the later call in ``load_plugins`` skips them),
4. verifies each target now reaches our hook through its ``__wrapped__`` chain, and
5. registers the backends in :data:`REGISTRATIONS` with SGLang's own registries
   (selected by a server flag, so inert until the launcher passes it),

and raises :class:`HookInstallError` -- a ``SystemExit``, which
``load_plugins``'s ``except Exception`` does not swallow -- when any step fails.

Caveat of step 3: another plugin that registers a hook on one of *our* targets
after we ran will find the target already patched and its hook skipped by
upstream. No other plugin we know of hooks these targets.

Each :class:`HookSpec` and :class:`RegistrationSpec` carries the same fields as
a patch header (Why, How, Upstream-Status, Removal, Tests) and is listed in the
site's table of changes against upstream (docs/reference/hooks.md).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
import pkgutil
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prfaas_sglang._compat import (
    DRAINED_ABORT_ACK,
    HOST_TENSOR_INDICES,
    KV_EVENTS_COMPONENT_TYPES,
    MAMBA_CAPACITY_ENSURED,
    METRICS_ROUTE_PATH,
    PD_ROLE_SWITCH,
    RADIX_TREES,
    RECEIVER_SEND_TIMEOUT,
    UNIFIED_TREE,
    Marker,
    change_status,
    installed_sglang_version,
    require_supported,
)
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import PrfaasError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ChangeNotes:
    """What a patch header says (Why, How, Upstream-Status, Removal, Tests), for a hook or a
    registered backend. Where it applies is decided by the upstream adapter's markers
    (:class:`~prfaas_sglang._compat.Marker`, named there), never by a version compare:
    ``upstream_marker`` is where an SGLang release shows that it does this itself (the change is
    *retired* there: not installed, not checked; ``rebase-check`` reports it); ``only_if`` names a
    marker a release must have for the change to apply there (a hook on a target only newer releases
    have). ``tests``: space-separated paths, run on every supported release."""

    subject: str
    why: str
    how: str
    upstream_status: str
    removal: str
    tests: str
    upstream_marker: Marker | tuple[str, str] | None = None
    only_if: Marker | tuple[str, str] | None = None

    def where(self, root=None) -> str:
        """``"applies"``, ``"retired"`` (upstream does it itself) or ``"not applicable"`` on the installed
        SGLang (``root``: another tree's directory holding ``sglang/``): :func:`~prfaas_sglang._compat.change_status`."""
        return change_status(self.upstream_marker, self.only_if, root)

    def applies(self, root=None) -> bool:
        return self.where(root) == "applies"


@dataclass(frozen=True, kw_only=True)
class HookSpec(ChangeNotes):
    """One runtime hook. ``hook`` is ``module:function``; ``hook_type`` a HookType value."""

    name: str
    target: str
    hook: str
    hook_type: str  # "before" | "after" | "around" | "replace"
    # str(inspect.signature(target)) at each supported release where it applies (the pin's first)
    expected_signature: str | tuple[str, ...]

    def load_hook(self) -> Callable:
        module_name, _, attr = self.hook.partition(":")
        return getattr(importlib.import_module(module_name), attr)


HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        name="role-contract",
        target="sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
        hook="prfaas_sglang.hooks.role_contract:check_role_contract",
        hook_type="after",
        expected_signature="(server_args: 'ServerArgs') -> 'None'",
        subject="[launch] Refuse server args that contradict the PrfaaS role",
        why=(
            "A PrfaaS or PD server started with passthrough flags that change its "
            "disaggregation mode or KV backend would join the deployment in the wrong role "
            "and fail only when the first request's KV goes nowhere."
        ),
        how=(
            "AFTER hook on SGLang's PD argument normalisation; with PRFAAS_ROLE set (by "
            "prfaas_sglang.launch) it checks mode, backend and MC_FORCE_TCP via "
            "prfaas_sglang.roles.role_contract_violations and raises."
        ),
        upstream_status="vendor-specific",
        removal="never: PrfaaS roles are this distribution's concept",
        tests="tests/unit/test_plugin.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-telemetry-start",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.__init__",
        hook="prfaas_sglang.hooks.kv_telemetry:start_link_telemetry",
        hook_type="after",
        expected_signature=("(self, args: 'KVArgs', disaggregation_mode: 'DisaggregationMode', "
                            "server_args: 'ServerArgs', is_mla_backend: 'Optional[bool]' = False)"),
        subject="[transport] A PrfaaS prefill worker publishes link telemetry",
        why=(
            "The router's threshold controller moves t with the cross-cluster link's capacity and "
            "congestion, which only the sender sees; SGLang publishes nothing about its KV transfers."
        ),
        how=(
            "AFTER hook on the Mooncake KV manager's constructor: in a prefill manager of a process "
            "with PRFAAS_ROLE=prfaas and PRFAAS_TELEMETRY_PORT, start a publisher thread (ZMQ PUB, "
            "wire.telemetry v3: the transfer meter and the kernel's TCP view of its Mooncake connections)."
        ),
        upstream_status="vendor-specific (upstream has no KV-transfer telemetry stream)",
        removal="when SGLang exports per-peer KV transfer metrics the router can read",
        tests="tests/transport/test_sglang_mooncake_cpu.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-send",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._transfer_data",
        hook="prfaas_sglang.hooks.kv_send_hook:send_transfer",
        hook_type="around",
        expected_signature="(self, mooncake_session_id, transfer_blocks)",
        subject="[transport] Send each chunk's KV without waiting on it; meter every batch",
        why=(
            "SGLang sends a chunk's KV as one synchronous batch that busy-waits, and the next chunk's "
            "only after it: over a WAN the lanes idle at every chunk's tail and a core spins per "
            "transfer thread. Telemetry needs each transfer's bytes, start and end, which Mooncake's "
            "Python API reduces to a return code."
        ),
        how=(
            "AROUND hook on the one place SGLang's Mooncake manager submits a chunk's KV: with an "
            "AsyncKvSender (PRFAAS_KV_ASYNC_SEND, prefill), merge adjacent entries (or, with a staging "
            "buffer, PRFAAS_KV_STAGING_MIB, group them by destination run, each run of scattered sources "
            "gathered into one write), queue them in the "
            "sender (at most 8 chunks per decode session), whose thread hands the engine a write per lane "
            "at a time, and return at once, or -1 once a write to that session failed; otherwise the "
            "original synchronous batch. Either way the manager's link meter records it. Never raises."
        ),
        upstream_status="vendor-specific (upstream: synchronous batches, sglang 0.5.15)",
        removal="when SGLang's Mooncake backend submits asynchronously and reports per-transfer progress",
        tests=("tests/transport/test_sglang_mooncake_cpu.py tests/transport/test_kv_send.py "
               "tests/transport/test_kv_stage.py tests/drift/test_hook_targets.py"),
    ),
    HookSpec(
        name="kv-send-start",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.__init__",
        hook="prfaas_sglang.hooks.kv_send_hook:start_async_sender",
        hook_type="after",
        expected_signature=("(self, args: 'KVArgs', disaggregation_mode: 'DisaggregationMode', "
                            "server_args: 'ServerArgs', is_mla_backend: 'Optional[bool]' = False)"),
        subject="[transport] A PrfaaS prefill manager gets an asynchronous KV sender",
        why="The kv-send hooks need per-manager state: the writes queued and in flight per decode session.",
        how=(
            "AFTER hook on the Mooncake KV manager's constructor: in a prefill manager of a process "
            "with PRFAAS_KV_ASYNC_SEND=1 (the launcher sets it for the prfaas role) whose transfer "
            "engine has transfer_submit_write / transfer_check_status, attach an AsyncKvSender (lanes "
            "from MC_TCP_LANES_PER_PEER; its connections to the decode peers reset on close; with "
            "PRFAAS_KV_LANE_PACING, an even batch's lanes paced alike; with PRFAAS_KV_STAGING_MIB, a "
            "staging buffer on the KV's device registered with the engine). A malformed "
            "PRFAAS_KV_LANE_PACING or PRFAAS_KV_STAGING_MIB, or a staging buffer that cannot be allocated "
            "or registered, stops startup."
        ),
        upstream_status="vendor-specific",
        removal="with kv-send",
        tests="tests/transport/test_kv_send.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-lane-keepalive",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.__init__",
        hook="prfaas_sglang.hooks.lane_keepalive:start_lane_keepalive",
        hook_type="after",
        expected_signature=("(self, args: 'KVArgs', disaggregation_mode: 'DisaggregationMode', "
                            "server_args: 'ServerArgs', is_mla_backend: 'Optional[bool]' = False)"),
        subject="[transport] TCP keepalive on the Mooncake connections of a WAN worker",
        why=(
            "Mooncake 0.3.13 sets no keepalive and its server session only reads: a lane the sender "
            "closed while the link was dark (the reset lost) stays open on the decode until the "
            "process ends, 4 per outage measured; an idle lane through a NAT dies silently."
        ),
        how=(
            "AFTER hook on the Mooncake KV manager's constructor: with PRFAAS_KV_KEEPALIVE set (the "
            "launcher sets it for the prfaas and pd-decode roles), a thread gives every new connection "
            "to or from a Mooncake port SO_KEEPALIVE with the given idle, interval and probe count."
        ),
        upstream_status="not yet proposed (Mooncake: keepalive on TCP transport sockets)",
        removal="when Mooncake's TCP transport sets keepalive itself",
        tests="tests/transport/test_kv_send.py tests/transport/test_sglang_session_recovery.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-send-aux-barrier",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_aux",
        hook="prfaas_sglang.hooks.kv_send_hook:aux_barrier",
        hook_type="around",
        expected_signature="(self, req: 'TransferInfo', prefill_aux_index: 'int', dst_aux_ptrs: 'list[int]')",
        subject="[transport] A room's KV has landed before its aux is sent",
        why=(
            "SGLang reports Success to the decode right after the last chunk's aux; with asynchronous "
            "KV writes the aux must wait for them, and fail the room if one of them failed."
        ),
        how=(
            "AROUND hook on send_aux: with an AsyncKvSender, wait (sleeping) until no write to the "
            "session is in flight; return -1 if one failed while the room was in flight, else send the "
            "aux synchronously."
        ),
        upstream_status="vendor-specific",
        removal="with kv-send",
        tests="tests/transport/test_kv_send.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-send-ack-drain",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._maybe_ack_drained_abort",
        hook="prfaas_sglang.hooks.kv_send_hook:hold_drained_ack",
        hook_type="around",
        expected_signature="(self, room: 'int') -> 'None'",
        subject="[transport] An aborted room's drained ACK waits for the sender's writes",
        why=(
            "SGLang 0.5.23 keeps an aborted room's decode pages until every prefill rank ACKs that its "
            "writes drained, judged by its own count of chunks in flight; with kv-send a chunk is counted "
            "done when its writes are queued, so the ACK would free pages still being written."
        ),
        how=(
            "AROUND hook on the manager's drained-ACK check: with an AsyncKvSender, hold the ACK until "
            "every batch queued or in flight at that moment has ended, then run SGLang's own check; "
            "poison the room (the decode frees on its release timeout) when one of those batches failed."
        ),
        upstream_status="vendor-specific (exists because of kv-send)",
        removal="with kv-send",
        tests="tests/transport/test_kv_send.py tests/drift/test_hook_targets.py",
        only_if=DRAINED_ABORT_ACK,
    ),
    HookSpec(
        name="cpu-sender-indices",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        hook="prfaas_sglang.hooks.cpu_engine:sender_host_indices_off",
        hook_type="after",
        expected_signature=("(self, mgr: 'CommonKVManager', bootstrap_addr: 'str', bootstrap_room: 'int', "
                            "req_has_disagg_prefill_dp_rank: 'bool' = False)"),
        subject="[engine] A CPU prefill server's Mooncake sender gets host page indices",
        why=(
            "SGLang 0.5.23's prefill hands a Mooncake sender its page indices through pinned memory and a CUDA "
            "event, with no device check: a disaggregated server on its CPU engine fails at its first KV send "
            "(no NVIDIA driver), so no PD deployment runs on CPU."
        ),
        how=(
            "AFTER hook on the sender's constructor: under SGLang's CPU engine (sglang.srt.utils.is_cpu) the "
            "instance says supports_host_tensor_indices = False, and the scheduler computes the same indices on "
            "the host, as it does for every other sender."
        ),
        upstream_status="upstream bug (0.5.23): the host-index path needs a CUDA-device guard; to be reported",
        removal="when SGLang's prefill guards its host-index path by device",
        tests="tests/transport/test_layerwise.py tests/drift/test_hook_targets.py",
        only_if=HOST_TENSOR_INDICES,
    ),
    HookSpec(
        name="decode-peer-rebootstrap",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager._on_heartbeat_success",
        hook="prfaas_sglang.hooks.peer_rebootstrap:forget_rebuilt_prefill",
        hook_type="after",
        expected_signature="(self, bootstrap_addr: 'str')",
        subject="[fault] A decode forgets a prefill that was switched in place and rebuilt",
        why=(
            "SGLang 0.5.23's decode caches a prefill's KV endpoints and registers with it once, and drops that "
            "only when the prefill's bootstrap server stops answering. A prefill switched to decode and back by "
            "/pd_role_switch rebuilds its KV manager on a new port, unregistered, while its bootstrap server "
            "answers throughout: every decode that had served it sends later requests to the old port, and "
            "they wait until they time out."
        ),
        how=(
            "AFTER hook on the decode's successful-heartbeat hook (upstream's seam for backend cleanup): ask the "
            "prefill's bootstrap server (/route) where the first cached rank is now; where it moved or is gone, "
            "SGLang's own _handle_node_failure drops the cache and fails that prefill's rooms in flight, and the "
            "next request bootstraps afresh. One GET per prefill per heartbeat."
        ),
        upstream_status="to report (sglang: a role switch leaves decode peers' connection cache stale)",
        removal="when SGLang's decode re-bootstraps a prefill whose KV manager was rebuilt (e.g. a registration "
                "generation in its bootstrap info)",
        tests="tests/unit/test_peer_rebootstrap.py tests/gpu/test_harness_sglang_cpu.py tests/drift/test_hook_targets.py",
        only_if=PD_ROLE_SWITCH,
    ),
    HookSpec(
        name="kv-layerwise-batch",
        target="sglang.srt.managers.scheduler.Scheduler.run_batch",
        hook="prfaas_sglang.hooks.layerwise_hook:stream_forward",
        hook_type="around",
        expected_signature=(
            "(self, batch: sglang.srt.managers.schedule_batch.ScheduleBatch, pp_proxy_tensors: "
            "Optional[sglang.srt.model_executor.forward_batch_info.PPProxyTensors] = None) -> "
            "Union[sglang.srt.managers.utils.GenerationBatchResult, sglang.srt.managers.utils.EmbeddingBatchResult]"),
        subject="[transport] Plan each prefill chunk's KV per layer before its forward",
        why=(
            "SGLang sends a chunk's KV only after the chunk's whole forward, so over a WAN the last "
            "chunk's transfer adds its full length to TTFT; streaming a layer as soon as it is written "
            "needs, before the forward, which pages of which request go to which decode pages."
        ),
        how=(
            "AROUND hook on the scheduler's run_batch: on a disaggregated prefill server whose Mooncake "
            "manager has a LayerStreamer (PRFAAS_KV_LAYERWISE=1), run SGLang's early cached-prefix send, "
            "plan every request's chunk with send_kv_chunk's own arithmetic and open it in a LayerLedger, "
            "and make the plan the current forward's (a context variable) while run_batch runs."
        ),
        upstream_status="vendor-specific (SGLang 0.5.15 has no layer-wise KV transfer)",
        removal="when SGLang's Mooncake backend streams KV per layer itself",
        tests="tests/transport/test_layerwise.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="kv-layerwise-layer",
        target="sglang.srt.layers.radix_attention.RadixAttention.forward",
        hook="prfaas_sglang.hooks.layerwise_hook:layer_written",
        hook_type="after",
        expected_signature=("(self, q, k, v, forward_batch: 'ForwardBatch', save_kv_cache: 'bool' = True, **kwargs)",
                            "(self, q, k, v, forward_batch: 'ForwardBatch', save_kv_cache: 'bool' = True, key_value_num_tokens: 'Optional[int]' = None, **kwargs)"),
        subject="[transport] Stream a layer's KV once the forward has written it",
        why=(
            "The only point every attention backend passes after writing a layer's KV (or fusing the "
            "write into its kernel) is the attention layer's forward returning."
        ),
        how=(
            "AFTER hook on RadixAttention.forward: inside a planned forward and on the target model's KV "
            "pool, record a blocking CUDA event and queue the layer; the streamer thread waits on it "
            "(sleeping) and submits the layer's blocks as asynchronous writes. Outside a planned forward "
            "it reads one context variable and returns."
        ),
        upstream_status="vendor-specific",
        removal="with kv-layerwise-batch",
        tests="tests/transport/test_layerwise.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="worker-api-key",
        target="sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
        hook="prfaas_sglang.hooks.deployment_auth:set_worker_api_key",
        hook_type="after",
        expected_signature="(server_args: 'ServerArgs') -> 'None'",
        subject="[security] A worker of a deployment with a secret demands the key derived from it",
        why=(
            "A worker's HTTP API starts prefills and decodes that contact hosts named in the request; only "
            "the router (and other workers) may call it. SGLang takes its API key only as --api-key, which "
            "every local user reads in the process list."
        ),
        how=(
            "AFTER hook on SGLang's PD argument normalisation: with PRFAAS_SECRET_FILE set, server_args.api_key "
            "becomes the deployment's derived worker key (wire.auth), so SGLang's own middleware guards every "
            "endpoint but /health* and /metrics; a different --api-key stops startup."
        ),
        upstream_status="vendor-specific (SGLang has no API-key file or environment variable)",
        removal="when SGLang reads its API key from a file or the environment",
        tests="tests/unit/test_security.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="bootstrap-peer-check",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        hook="prfaas_sglang.hooks.deployment_auth:check_bootstrap_peer",
        hook_type="before",
        expected_signature="(self, obj: 'Union[GenerateReqInput, EmbeddingReqInput]', input_ids: 'List[int]') -> 'None'",
        subject="[security] A request's bootstrap host must be a peer from the topology",
        why=(
            "A decode worker registers with whatever bootstrap_host a request names, and its KV manager then "
            "talks to that host: a request can point a worker at any machine."
        ),
        how=(
            "BEFORE hook on the tokenizer manager's per-request validation: with PRFAAS_PEER_HOSTS set (the "
            "launcher sets it from the topology), a bootstrap_host outside it raises ValueError, which SGLang "
            "answers with 400 before anything is scheduled."
        ),
        upstream_status="vendor-specific",
        removal="when SGLang checks bootstrap hosts against a configured peer list",
        tests="tests/unit/test_security.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="input-ids-in-vocab",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        hook="prfaas_sglang.hooks.deployment_auth:check_ids_in_vocab",
        hook_type="before",
        expected_signature="(self, obj: 'Union[GenerateReqInput, EmbeddingReqInput]', input_ids: 'List[int]') -> 'None'",
        subject="[input] Prompt ids outside the vocabulary get 400, not an out-of-bounds embedding read",
        why=(
            "SGLang 0.5.15 defines _validate_input_ids_in_vocab but never calls it, and its tp=1 embedding "
            "does not mask: one id >= vocab_size reads out of bounds on the GPU (garbage, or a device "
            "assert that ends the worker and every request on it)."
        ),
        how=(
            "BEFORE hook on the tokenizer manager's per-request validation: max/min of the prompt ids against "
            "model_config.vocab_size (C speed); out of range raises ValueError, SGLang's 400. Multimodal "
            "requests are left alone."
        ),
        upstream_status="bug in 0.5.15: the check exists upstream, uncalled",
        removal="when SGLang calls its vocabulary check on every request",
        tests="tests/unit/test_security.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="decode-state-slot",
        target="sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
        hook="prfaas_sglang.hooks.decode_radix:make_room_for_state",
        hook_type="before",
        expected_signature=("(self, req: 'Req', prefix_indices: 'Optional[torch.Tensor]' = None, prefix_len: "
                            "'Optional[int]' = None, total_prefix_len: 'Optional[int]' = None) -> 'torch.Tensor'"),
        subject="[cache] A decode request's state slot evicts a cached state when the pool has none free",
        why=(
            "With the decode radix cache on a hybrid model (patch 0001), finished requests donate their state "
            "slots to the tree, from the pool decode requests take theirs from; DecodePreallocQueue._pre_alloc "
            "takes a slot without evicting, and the allocator asserts once the tree holds the free ones."
        ),
        how=(
            "BEFORE hook on _pre_alloc: with the prfaas-hybrid decode cache (DecodeMambaRadixCache) and no free "
            "state slot, evict the least recently used unlocked state (EvictParams(mamba_num=1)), as SGLang's "
            "colocated admission does in alloc_req_slots. Anything else: nothing."
        ),
        upstream_status="not-yet (upstream's fix in sgl-project/sglang#38634 allocates through alloc_req_slots)",
        removal="with patch 0001, when the pinned SGLang has the decode radix cache for Mamba/SSM models",
        tests="tests/engine/test_decode_radix_hybrid.py tests/drift/test_hook_targets.py",
        upstream_marker=MAMBA_CAPACITY_ENSURED,  # 0.5.23, #38634
    ),
    HookSpec(
        name="decode-contiguous-kv",
        target="sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
        hook="prfaas_sglang.hooks.contiguous_alloc:contiguous_prealloc",
        hook_type="around",
        expected_signature=("(self, req: 'Req', prefix_indices: 'Optional[torch.Tensor]' = None, prefix_len: "
                            "'Optional[int]' = None, total_prefix_len: 'Optional[int]' = None) -> 'torch.Tensor'"),
        subject="[transport] A decode worker takes a prompt's KV slots in one run where it can",
        why=(
            "SGLang's Mooncake sender writes one request per layer per run of slots contiguous on both "
            "sides, and a Mooncake TCP lane carries one request per RTT. SGLang's page-1 allocator gives a "
            "prompt the first free slots of its sorted list: once the pool has turned over, the "
            "single-slot holes interleaved decode steps left, so a transfer over the WAN splits into "
            "~190 requests per layer on the conversation trace and the link idles (bench kv-runs)."
        ),
        how=(
            "AROUND hook on _pre_alloc: with PRFAAS_DECODE_CONTIGUOUS_KV (the launcher's decode profile) "
            "and a page-1 TokenToKVPoolAllocator with a sorted free list, the pre-allocation's one alloc "
            "takes the smallest run of consecutive free slots that holds the prompt (after SGLang's own "
            "merge_and_sort_free if needed), else SGLang's choice. Other page sizes, SWA and HiSparse: unchanged."
        ),
        upstream_status="vendor-specific (an allocation policy for TCP transfers; not proposed)",
        removal="when SGLang's Mooncake sender stages a transfer into one request, or Mooncake TCP pipelines requests per lane",
        tests="tests/engine/test_contiguous_alloc.py tests/bench/test_kv_runs.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="decode-staging-start",
        target="sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__",
        hook="prfaas_sglang.hooks.decode_stage:start_decode_staging",
        hook_type="after",
        expected_signature=((
            "(self, req_to_token_pool: 'ReqToTokenPool', token_to_kv_pool_allocator: 'BaseTokenToKVPoolAllocator', "
            "draft_token_to_kv_pool: 'Optional[KVCache]', req_to_metadata_buffer_idx_allocator: "
            "'ReqToMetadataIdxAllocator', metadata_buffers: 'MetadataBuffers', scheduler: 'Scheduler', "
            "transfer_queue: 'DecodeTransferQueue', tree_cache: 'BasePrefixCache', gloo_group: 'ProcessGroup', "
            "tp_rank: 'int', tp_size: 'int', dp_size: 'int', gpu_id: 'int', bootstrap_port: 'int', "
            "max_total_num_tokens: 'int', pp_rank: 'int', num_reserved_decode_tokens: 'int', "
            "transfer_backend: 'TransferBackend')"),
                            "(self, req_to_token_pool: 'ReqToTokenPool', token_to_kv_pool_allocator: 'BaseTokenToKVPoolAllocator', draft_token_to_kv_pool: 'Optional[KVCache]', req_to_metadata_buffer_idx_allocator: 'ReqToMetadataIdxAllocator', metadata_buffers: 'MetadataBuffers', scheduler: 'Scheduler', transfer_queue: 'DecodeTransferQueue', tree_cache: 'BasePrefixCache', gpu_id: 'int', bootstrap_port: 'int', max_total_num_tokens: 'int', num_reserved_decode_tokens: 'int', transfer_backend: 'TransferBackend')"),
        subject="[transport] A decode worker sets a run of KV pages aside to receive scattered prompts in",
        why=(
            "When the decode pool has no free run for a prompt, its pages are scattered and the prefill "
            "writes a request per run over the WAN (a lane idles an RTT per request); with the pool near "
            "full that is ~1,000 requests per transfer on the conversation trace (bench kv-runs)."
        ),
        how=(
            "AFTER hook on the decode's pre-allocation queue: with PRFAAS_DECODE_STAGING_TOKENS > 0 (the "
            "launcher's decode profile) and a Mooncake KV manager, take that many tokens from the fresh pool "
            "as one run of pages (SGLang's allocator never hands them out again) and attach a DecodeStaging "
            "to the manager. A malformed value stops startup; a pool that cannot give one run runs without."
        ),
        upstream_status="vendor-specific",
        removal="when SGLang's Mooncake backend stages same-TP transfers (its heterogeneous-TP staging buffer, "
                "SGLANG_DISAGG_STAGING_BUFFER, does for unequal TP)",
        tests="tests/transport/test_decode_stage.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="decode-staging-redirect",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver.send_metadata",
        hook="prfaas_sglang.hooks.decode_stage:redirect_metadata",
        hook_type="around",
        expected_signature=(("(self, kv_indices: 'npt.NDArray[np.int32]', aux_index: 'Optional[int]' = None, "
                            "state_indices: 'Optional[List]' = None, decode_prefix_len: 'Optional[int]' = None)"),
                            "(self, kv_indices: 'npt.NDArray[np.int32]', aux_index: 'Optional[int]' = None, state_indices: 'Optional[List]' = None, decode_prefix_len: 'Optional[int]' = None, destination: 'KVTransferDestination' = <KVTransferDestination.DEVICE: 'device'>, device_kv_indices: 'Optional[npt.NDArray[np.int32]]' = None)"),
        subject="[transport] A scattered prompt's KV is written into the decode's reserve in one run",
        why="See decode-staging-start: the prefill writes one request per run of the pages the decode names.",
        how=(
            "AROUND hook on the receiver's metadata send: with a DecodeStaging on the manager and the "
            "prompt's KV pages in several small runs, name a run of reserve pages of the same length "
            "instead (when the reserve has room; otherwise the prompt's own). State indices unchanged."
        ),
        upstream_status="vendor-specific",
        removal="with decode-staging-start",
        tests="tests/transport/test_decode_stage.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="decode-staging-land",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver.poll",
        hook="prfaas_sglang.hooks.decode_stage:land_on_poll",
        hook_type="around",
        expected_signature="(self) -> 'KVPoll'",
        subject="[transport] A redirected room's KV is copied home before the decode uses it",
        why="See decode-staging-redirect: the KV landed in the reserve, and the request reads its own pages.",
        how=(
            "AROUND hook on the receiver's poll: when a redirected room reports Success, copy its pages from "
            "the reserve to its own (every KV buffer, one index_copy each, waited for) and free the reserve "
            "pages, before SGLang sees Success; on Failed, free them after the stall bound (a write may still "
            "land). A copy that fails fails the room."
        ),
        upstream_status="vendor-specific",
        removal="with decode-staging-start",
        tests="tests/transport/test_decode_stage.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="abort-notify-nonblocking",
        target="sglang.srt.disaggregation.common.conn.CommonKVReceiver._send_abort_notification",
        hook="prfaas_sglang.hooks.receiver_sends:notify_without_blocking",
        hook_type="around",
        expected_signature="(self)",
        subject="[fault] A decode's abort notice to a dead prefill does not block its scheduler",
        why=(
            "SGLang sends the best-effort abort notice on the receiver's cached ZMQ PUSH socket "
            "(RECONNECT_IVL -1, no send timeout) from the decode scheduler's main thread; once that prefill "
            "died the socket has no peer and the send blocks forever, hanging every request on the decode "
            "(real SGLang on CPU, gpu-e2e --checks failover: 8 of 8 long requests hung)."
        ),
        how=(
            "AROUND hook on the notice: SGLang's own code, with this call's send_multipart made with "
            "zmq.NOBLOCK; to a dead peer it raises zmq.Again at once and SGLang's own except logs it."
        ),
        upstream_status="to report (sglang.srt.disaggregation.common.conn: abort notice blocks on a dead peer)",
        removal="when SGLang's abort notice sends without blocking or its receiver sockets get a send timeout",
        tests="tests/transport/test_receiver_sends.py tests/drift/test_hook_targets.py",
        upstream_marker=RECEIVER_SEND_TIMEOUT,  # 0.5.23: receiver sockets send with a timeout
    ),
    HookSpec(
        name="metadata-send-nonblocking",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver.send_metadata",
        hook="prfaas_sglang.hooks.receiver_sends:send_metadata_without_blocking",
        hook_type="around",
        expected_signature=("(self, kv_indices: 'npt.NDArray[np.int32]', aux_index: 'Optional[int]' = None, "
                            "state_indices: 'Optional[List]' = None, decode_prefix_len: 'Optional[int]' = None)"),
        subject="[fault] A decode's metadata to a dead prefill fails the room instead of blocking its scheduler",
        why=(
            "See abort-notify-nonblocking: the decode's cached PUSH socket to a prefill that died blocks every "
            "send until the heartbeat drops it (~10 s); a request whose prefill leg went there in that window "
            "sends its metadata on it and hangs the decode."
        ),
        how=(
            "AROUND hook on the receiver's metadata send: SGLang's own code (and decode-staging-redirect's) "
            "with this call's sends made with zmq.NOBLOCK; zmq.Again records the room failed, as SGLang does "
            "for a prefill it could not reach at bootstrap."
        ),
        upstream_status="to report (with abort-notify-nonblocking)",
        removal="with abort-notify-nonblocking",
        tests="tests/transport/test_receiver_sends.py tests/drift/test_hook_targets.py",
        upstream_marker=RECEIVER_SEND_TIMEOUT,
    ),
    HookSpec(
        name="metrics-route-path",
        target="sglang.srt.utils.common._get_fastapi_request_path",
        hook="prfaas_sglang.hooks.http_metrics:route_path",
        hook_type="around",
        expected_signature="(request) -> 'Tuple[str, bool]'",
        subject="[compat] SGLang's HTTP metrics middleware names routes of included routers",
        why=(
            "With --enable-metrics (the launcher's default) SGLang labels each request with its route's "
            ".path; FastAPI 0.165 lists an included router as one route without .path, so every request to "
            "one (GET /v1/loads, which our router polls) failed with HTTP 500 (real SGLang on CPU)."
        ),
        how=(
            "AROUND hook on the path lookup: SGLang's answer where it has one; where the matching route has "
            "no .path, the request's own path."
        ),
        upstream_status="to propose (sglang.srt.utils.common assumes every route has .path)",
        removal="when SGLang's middleware handles routes without .path, or FastAPI is pinned below 0.165",
        tests="tests/unit/test_http_metrics.py tests/drift/test_hook_targets.py",
        upstream_marker=METRICS_ROUTE_PATH,
    ),
    HookSpec(
        name="metrics-multiproc-values",
        target="sglang.srt.utils.common.set_prometheus_multiproc_dir",
        hook="prfaas_sglang.hooks.http_metrics:multiprocess_values",
        hook_type="after",
        expected_signature="()",
        subject="[compat] SGLang's tokenizer metrics reach /metrics although our plugin loads prometheus_client early",
        why=(
            "prometheus_client chooses in-process or multiprocess values once, at its first import; our plugin "
            "resolves its hook targets at load, before SGLang sets PROMETHEUS_MULTIPROC_DIR, and SGLang's "
            "mooncake.conn imports prometheus_client at module level, so the HTTP process's metrics "
            "(sglang:num_requests_total, TTFT and latency histograms) were missing from /metrics (real SGLang on CPU)."
        ),
        how=(
            "AFTER hook on SGLang's setting of the multiprocess directory: prometheus_client's value class is "
            "chosen again (values.get_value_class()), so the collectors SGLang builds next write there."
        ),
        upstream_status="vendor-specific (a consequence of resolving hook targets at plugin load)",
        removal="when the plugin no longer imports sglang.srt.disaggregation.mooncake.conn at load, or SGLang "
                "sets the directory before loading plugins",
        tests="tests/unit/test_http_metrics.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="cache-move-routes",
        target="sglang.srt.entrypoints.http_server._setup_and_run_http_server",
        hook="prfaas_sglang.hooks.cache_move_hook:add_routes",
        hook_type="before",
        expected_signature=(
            "(server_args: sglang.srt.server_args.ServerArgs, tokenizer_manager, template_manager, port_args: "
            "sglang.srt.server_args.PortArgs, scheduler_infos: List[Dict], subprocess_watchdog: "
            "Optional[sglang.srt.utils.watchdog.SubprocessWatchdog], execute_warmup_func: Callable = "
            "<function _execute_server_warmup>, launch_callback: Optional[Callable[[], NoneType]] = None)"),
        subject="[cache] A prefill server takes cache moves: POST /prfaas/cache/import and /export",
        why=(
            "The router moves a prefix cached in the other cluster to the chosen prefill worker before "
            "its prefill (RouteDecision.transfer); SGLang has no endpoint that imports or exports a "
            "cached prefix."
        ),
        how=(
            "BEFORE hook on the function that starts the HTTP server: with PRFAAS_ROLE prfaas or "
            "pd-prefill, add the two routes (wire.cache_move) to SGLang's FastAPI app, behind its "
            "--api-key middleware; they forward the body over ZMQ to the scheduler's agent "
            "(hooks/cache_move_hook). An export must carry the deployment's hand-off signature. A server that "
            "cannot move (tp/pp/dp > 1, not prefill, not Mooncake) answers 501 with the reason."
        ),
        upstream_status="vendor-specific (upstream has no cross-cluster cache import)",
        removal="never: cache moves between PrfaaS and PD clusters are this distribution's",
        tests="tests/engine/test_cache_move_sglang.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="cache-move-agent",
        target="sglang.srt.managers.scheduler.Scheduler.__init__",
        hook="prfaas_sglang.hooks.cache_move_hook:start_agent",
        hook_type="after",
        expected_signature=((
            "(self, server_args: sglang.srt.server_args.ServerArgs, port_args: sglang.srt.server_args.PortArgs, "
            "gpu_id: int, tp_rank: int, moe_ep_rank: int, pp_rank: int, attn_cp_rank: int, moe_dp_rank: int, "
            "dp_rank: Optional[int])"),
                            '(self, server_args: sglang.srt.server_args.ServerArgs, port_args: sglang.srt.server_args.PortArgs)'),
        subject="[cache] A prefill scheduler runs the cache-move agent",
        why=(
            "A cache move reads or fills the scheduler's tree and pools, which only the scheduler's "
            "thread may touch, and waits on HTTP and Mooncake, which it must not."
        ),
        how=(
            "AFTER hook on the scheduler's constructor: on a prefill server that can move (the routes' "
            "rule), start a CacheMoveAgent (ZMQ ROUTER beside SGLang's scheduler socket, a small thread "
            "pool for HTTP and Mooncake writes through the prefill queue's Mooncake engine)."
        ),
        upstream_status="vendor-specific",
        removal="with cache-move-routes",
        tests="tests/engine/test_cache_move_sglang.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="cache-move-steps",
        target="sglang.srt.managers.scheduler.Scheduler.process_input_requests",
        hook="prfaas_sglang.hooks.cache_move_hook:run_steps",
        hook_type="after",
        expected_signature="(self, recv_reqs: List)",
        subject="[cache] The scheduler runs cache-move steps between forward passes",
        why="Export copies out of, and import inserts into, the scheduler's tree and pools.",
        how=(
            "AFTER hook on process_input_requests (every loop iteration, before scheduling the next "
            "batch): run the agent's queued steps (export_prefix, import_prefix, a match). Without an "
            "agent: nothing."
        ),
        upstream_status="vendor-specific",
        removal="with cache-move-routes",
        tests="tests/engine/test_cache_move_sglang.py tests/drift/test_hook_targets.py",
    ),
    HookSpec(
        name="scheduler-poll-wait",
        target="sglang.srt.managers.scheduler.Scheduler.on_idle",
        hook="prfaas_sglang.hooks.poll_wait:wait_for_input",
        hook_type="after",
        expected_signature="(self)",
        subject="[engine] A scheduler that ran no batch waits on its sockets instead of spinning",
        why=(
            "--sleep-on-idle sleeps only when the scheduler is fully idle: a PD server with a request in "
            "flight but nothing to run polls its queues without pause, a whole core (a decode burned 1.98 "
            "CPU-s beside its prefill's 1.94 s, on two cores shared with that prefill)."
        ),
        how=(
            "AFTER hook on Scheduler.on_idle (called when a loop iteration ran no batch): with "
            "PRFAAS_POLL_WAIT_MS set, poll the tokenizer's and RPC sockets for up to that long; a new "
            "request wakes it at once, a transfer's end is seen at most that late. Unset: nothing."
        ),
        upstream_status="not yet proposed (SGLang: an idle wait while disaggregation queues wait)",
        removal="when SGLang's PD loops wait instead of polling while their queues wait on I/O",
        tests="tests/unit/test_poll_wait.py tests/drift/test_hook_targets.py",
    ),
)


@dataclass(frozen=True, kw_only=True)
class RegistrationSpec(ChangeNotes):
    """A backend registered with one of SGLang's registries, selected by ``selected_by``.
    ``overrides``: the upstream methods its implementation subclasses or relies on, each with
    its signature at the pinned release (checked by the drift tests like a hook's target)."""

    name: str
    registry: str  # dotted path of the registering function
    selected_by: str
    overrides: tuple[tuple[str, str | tuple[str, ...]], ...]  # (target, its signature(s) where this applies)

    hook_type = "registry"  # the changes table's mechanism column (docs/reference/hooks.md)

    @property
    def target(self) -> str:
        return self.registry


REGISTRATIONS: tuple[RegistrationSpec, ...] = (
    RegistrationSpec(
        name="prfaas-hybrid",
        registry="sglang.srt.mem_cache.registry.register_radix_cache_backend",
        selected_by="--radix-cache-backend prfaas-hybrid",
        overrides=(
            ("sglang.srt.mem_cache.registry.default_radix_cache_factory", "(ctx: 'TreeCacheBuildContext') -> 'BasePrefixCache'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.__init__", "(self, params: 'CacheInitParams')"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.reset", "(self) -> 'None'"),
            ("sglang.srt.mem_cache.events.KVCacheEventMixin.take_events", "(self)"),  # inherited by MambaRadixCache
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._insert_helper",
             "(self, node: 'TreeNode', key: 'RadixKey', value, mamba_value, chunked: 'bool' = False, "
             "prev_prefix_len: 'int' = 0) -> 'Tuple[int, bool]'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._tombstone_internal_node",
             "(self, node: 'TreeNode') -> 'None'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._delete_leaf", "(self, node: 'TreeNode') -> 'None'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.match_prefix",
             "(self, params: 'MatchPrefixParams') -> 'MatchResult'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.cache_unfinished_req",
             "(self, req: 'Req', chunked=False) -> 'None'"),
            ("sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.cache_finished_req",
             "(self, req: 'Req', is_insert: 'bool' = True) -> 'None'"),
            ("sglang.srt.mem_cache.common.maybe_cache_unfinished_req", "(req: 'Req', tree_cache: 'BasePrefixCache', **kwargs)"),
            ("sglang.srt.mem_cache.common.release_kv_cache",
             "(req: 'Req', tree_cache: 'BasePrefixCache', is_insert: 'bool' = True)"),
            ("sglang.srt.mem_cache.radix_cache.RadixCache.__init__", "(self, params: 'CacheInitParams')"),
            ("sglang.srt.mem_cache.radix_cache.RadixCache.match_prefix", "(self, params: 'MatchPrefixParams') -> 'MatchResult'"),
            ("sglang.srt.mem_cache.radix_cache.RadixCache.cache_unfinished_req", "(self, req: 'Req', chunked=False)"),
            ("sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req", "(self, req: 'Req', is_insert: 'bool' = True)"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.__init__", "(self, params: 'CacheInitParams')"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.reset", "(self) -> 'None'"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.match_prefix",
             "(self, params: 'MatchPrefixParams') -> 'MatchResult'"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.cache_unfinished_req",
             "(self, req: 'Req', chunked=False) -> 'None'"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.cache_finished_req",
             "(self, req: 'Req', is_insert: 'bool' = True) -> 'None'"),
            ("sglang.srt.mem_cache.common.free_swa_out_of_window_slots",
             "(req: 'Req', pre_len: 'int', *, sliding_window_size: 'int', page_size: 'int', "
             "req_to_token_pool: 'ReqToTokenPool', token_to_kv_pool_allocator: 'BaseTokenToKVPoolAllocator', "
             "is_chunk_cache: 'bool' = False) -> 'None'"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache._add_new_node",
             "(self, parent: 'TreeNode', key: 'RadixKey', value: 'torch.Tensor', swa_tombstone: 'bool' = False) "
             "-> 'TreeNode'"),
            ("sglang.srt.mem_cache.swa_radix_cache.SWARadixCache._compact_single_child_chain",
             "(self, node: 'TreeNode') -> 'None'"),
            ("sglang.srt.mem_cache.swa_radix_cache.LRUList.__init__", "(self, is_swa_list: 'bool' = False)"),
            ("sglang.srt.mem_cache.swa_radix_cache.LRUList.insert_mru", "(self, node)"),
            ("sglang.srt.mem_cache.swa_radix_cache.LRUList.remove_node", "(self, node: 'TreeNode')"),
            ("sglang.srt.mem_cache.swa_radix_cache.LRUList.in_list", "(self, node: 'Optional[TreeNode]')"),
        ),
        subject=("[cache] Hybrid models' Mamba state checkpoints and sliding-window pages are published as KV "
                 "events; a PrfaaS worker keeps only prefixes worth keeping"),
        why=(
            "MambaRadixCache publishes pages only: storing or evicting a prefix's linear-attention state emits "
            "nothing, yet it decides how much of the prefix a hybrid model reuses, so a KV index either "
            "guesses checkpoints or overstates hits after every state eviction. SWARadixCache likewise frees a "
            "page's sliding-window KV (a tombstone) without an event."
        ),
        how=(
            "A radix-cache backend (hooks/cache_backend.py, its caches in hooks/hybrid_cache.py): SGLang's default selection chain, with a "
            "MambaRadixCache subclass that records StateStored when an insert leaves a state at the key's end "
            "and StateRemoved when a node is tombstoned or an evicted leaf takes its state along; "
            "take_events() hands them to the publisher inside the list SGLang passes on. For sliding-window "
            "models, an SWARadixCache subclass publishes which stored pages lose their window KV and get it "
            "back (\"swa\" StateRemoved/StateStored with the window; its SWA LRU list notes every node whose "
            "window KV came or went), so the kv-index applies SGLang's window rule. With "
            "PRFAAS_PREFILL_CACHE (the launcher sets auto for the prfaas role) each request is decided at its "
            "first match: a transfer-cache request takes SGLang's no-insert path for its chunks and finishes "
            "with is_insert=False, so its KV is freed once its transfer completes; in the Mamba cache, in the "
            "SWA cache (whose transfer-cache requests free their own out-of-window KV per chunk, as SGLang's "
            "chunk cache does) and, for full-attention models, in a RadixCache subclass built where the "
            "default chain builds a RadixCache. A request's custom_params.prfaas_checkpoint_tokens (a router's "
            "checkpoint hint) becomes the Mamba match's mamba_branching_seqlen where SGLang found none, so its "
            "extra-buffer scheduling keeps a state there; a prefill not kept otherwise is inserted only at "
            "that forward (its prefix and state), the rest freed once sent."
        ),
        upstream_status="the shape of upstream's component-typed KV events (main's --enable-kv-events-component-types, "
                        "sglang PR #32514; not in the 0.5.23 wheel)",
        removal="when the pin reaches a release with component KV events and the kv-index reads them",
        tests="tests/engine/test_state_events.py tests/drift/test_hook_targets.py",
        upstream_marker=KV_EVENTS_COMPONENT_TYPES,
        only_if=RADIX_TREES,
    ),
    RegistrationSpec(
        name="prfaas-hybrid-unified",
        registry="sglang.srt.mem_cache.registry.register_radix_cache_backend",
        selected_by="--radix-cache-backend prfaas-hybrid",
        overrides=(
            ("sglang.srt.mem_cache.registry.default_radix_cache_factory", "(ctx: 'TreeCacheBuildContext') -> 'BasePrefixCache'"),
            ("sglang.srt.mem_cache.registry.create_unified_radix_cache",
             "(ctx: 'TreeCacheBuildContext', *, cache_class: 'type[UnifiedRadixCache] | None' = None) -> 'BasePrefixCache'"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__", "(self, params: 'CacheInitParams')"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix",
             "(self, params: 'MatchPrefixParams') -> 'MatchResult'"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
             "(self, req: 'Req', *, up_to: 'int', **kwargs) -> 'None'"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release",
             "(self, req: 'Req', *, checkpointed: 'bool') -> 'None'"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset", "(self) -> 'None'"),
            ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.take_events", "(self)"),
            ("sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.commit_insert_component_data",
             "(self, node: 'UnifiedTreeNode', is_new_leaf: 'bool', params: 'InsertParams', result: 'InsertResult', "
             "cache_actions: 'list[CacheAction | ComponentAction]') -> 'None'"),
            ("sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.evict_component",
             "(self, node: 'UnifiedTreeNode', device_frees: 'dict[ComponentType, list[torch.Tensor]]', "
             "host_frees: 'dict[ComponentType, list[torch.Tensor]]', cache_actions: "
             "'list[CacheAction | ComponentAction]', target: 'EvictLayer' = <EvictLayer.DEVICE: 1>) -> 'tuple[int, int]'"),
            ("sglang.srt.mem_cache.events.KVCacheEventRecorder._node_event_hash_values", "(self, node: 'Any') -> 'list'"),
            ("sglang.srt.mem_cache.events.KVCacheEventRecorder._namespace_seed",
             "(self, node: 'Any') -> 'Optional[bytes]'"),
            ("sglang.srt.mem_cache.common.checkpoint_kv_cache", "(req: 'Req', tree_cache: 'BasePrefixCache') -> 'None'"),
            ("sglang.srt.mem_cache.common.release_kv_cache",
             "(req: 'Req', tree_cache: 'BasePrefixCache', *, checkpoint: 'bool')"),
        ),
        subject=("[cache] prfaas-hybrid on SGLang's unified radix tree: Mamba state events and a PrfaaS worker's "
                 "prefill admission"),
        why=(
            "SGLang 0.5.23 builds every radix cache as one unified tree (mem_cache/unified_radix_cache.py) whose "
            "events, like 0.5.15's, publish pages only: a Mamba state stored on a prefix or evicted from it (its "
            "pages staying) emits nothing, so a KV index overstates a hybrid model's hits. A PrfaaS worker's tree "
            "must still keep one-off long prefills out."
        ),
        how=(
            "The same backend name: on a release with the unified tree, hooks/unified_cache.build_unified builds "
            "SGLang's own tree (create_unified_radix_cache's cache_class) where the default chain builds a working "
            "one. For a hybrid-SSM model its Mamba component is a subclass (CacheInitParams."
            "component_registry_override; SGLang then runs its Python tree core) that tells the cache each node "
            "whose device state it stored or evicted; the cache queues StateStored/StateRemoved, hashed as its "
            "recorder hashes the node's last page, and take_events() hands them to the publisher inside the list "
            "SGLang passes on. With PRFAAS_PREFILL_CACHE each request is decided at its first match and a "
            "transfer-cache request is marked skip_radix_cache_insert, SGLang's own bar from the tree: no chunk is "
            "checkpointed and release_kv_cache frees its KV and state once sent. Not ported (0.5.15 has them): the "
            "checkpoint hint's keep-to-checkpoint, sliding-window state events, cache import/export; the decode "
            "radix cache for Mamba models is upstream's own here (state-aware)."
        ),
        upstream_status="the shape of upstream's component-typed KV events (main's --enable-kv-events-component-types, "
                        "sglang PR #32514; not in the 0.5.23 wheel)",
        removal="when the pin reaches a release with component KV events and the kv-index reads them",
        tests="tests/engine/test_unified_cache.py tests/drift/test_hook_targets.py",
        upstream_marker=KV_EVENTS_COMPONENT_TYPES,
        only_if=UNIFIED_TREE,
    ),
    RegistrationSpec(
        name="prfaas-zmq",
        registry="sglang.srt.disaggregation.kv_events.EventPublisherFactory.register_publisher",
        selected_by="--kv-events-config '{\"publisher\": \"prfaas-zmq\", ...}'",
        overrides=(
            ("sglang.srt.disaggregation.kv_events.ZmqEventPublisher.__init__",
             ("(self, attn_dp_rank: int, endpoint: str = 'tcp://*:5557', replay_endpoint: Optional[str] = None, "
              "buffer_steps: int = 10000, hwm: int = 100000, max_queue_size: int = 100000, topic: str = '') -> None",
              "(self, attn_dp_rank: int, endpoint: str = 'tcp://*:5557', replay_endpoint: Optional[str] = None, "
              "buffer_steps: int = 10000, hwm: int = 100000, max_queue_size: int = 100000, topic: str = '', "
              "bind: Optional[bool] = None) -> None")),
            ("sglang.srt.disaggregation.kv_events.ZmqEventPublisher.publish",
             "(self, events: sglang.srt.disaggregation.kv_events.EventBatch) -> None"),
            ("sglang.srt.disaggregation.kv_events.ZmqEventPublisher._socket_setup", "(self) -> None"),
            ("sglang.srt.disaggregation.kv_events.ZmqEventPublisher.shutdown", "(self) -> None"),
        ),
        subject="[cache] KV-event batches carry the cache's state events (wire v2, ignored by v1 consumers)",
        why=(
            "SGLang's batch has no place for state events, and a new event tag in its event list would make "
            "every existing consumer (SGLang's own decoder, Dynamo) refuse the whole batch."
        ),
        how=(
            "SGLang's ZmqEventPublisher (same sockets, sequence numbers and replay), publishing each batch "
            "with the cache's state events as a 4th array element, which msgspec decoders of the 3-element "
            "batch skip. Its PUB socket always binds the configured host (upstream connects unless the "
            "endpoint is a wildcard) and, with PRFAAS_SECRET_FILE, it and the replay socket are CURVE servers "
            "admitting only the deployment's clients (their context closed at shutdown)."
        ),
        upstream_status="vendor-specific (upstream 0.5.23 puts component events in the event list instead)",
        removal="with prfaas-hybrid",
        tests="tests/engine/test_state_events.py tests/drift/test_hook_targets.py",
        upstream_marker=KV_EVENTS_COMPONENT_TYPES,
    ),
)


class HookInstallError(SystemExit):
    """A hook could not be installed: stops the process (SGLang only logs ``Exception``)."""

    def __init__(self, message: str):
        super().__init__(f"prfaas_sglang plugin: {message}")
        self.message = message


def resolve_target(target: str) -> object:
    """The object at dotted path ``target`` (module attribute or class attribute). Where a module on the
    path fails to import, raises that ImportError (``pkgutil.resolve_name`` would report only a missing
    attribute of its package)."""
    owner_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except AttributeError as err:
        _raise_import_failure(owner_path, err)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    return getattr(owner, attr)


def _raise_import_failure(dotted: str, err: AttributeError) -> None:
    """Re-raise ``err`` as the ImportError of the first module on ``dotted`` that exists but fails to
    import (a dependency it needs is missing, say); ``err`` itself where none does."""
    parts = dotted.split(".")
    for cut in range(1, len(parts) + 1):
        name = ".".join(parts[:cut])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as cause:
            if cause.name == name:  # not a module: the rest of the path is attributes
                break
            raise ImportError(f"importing {name}: {cause}") from cause
        except ImportError as cause:
            raise ImportError(f"importing {name}: {cause}") from cause
    raise err


def reaches_hook(obj: object, hook: Callable) -> bool:
    """True if ``obj`` is ``hook`` or a wrapper chain (``__wrapped__``) that closes over it."""
    seen = 0
    while obj is not None and seen < 64:
        if obj is hook:
            return True
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return False


def import_hook_modules(specs: Sequence[HookSpec] = HOOKS) -> None:
    """Import what :func:`install_hooks` would import for ``specs`` (each applicable hook and its target's
    module), registering nothing: a process that forks probes (:mod:`prfaas_sglang.bench.zygote`) preloads
    it, and a probe that registers the plugin then pays for the registration only. A target that does not
    resolve is left to :func:`install_hooks` to report."""
    for spec in specs:
        if not spec.applies():
            continue
        with contextlib.suppress(ImportError, AttributeError, ValueError):
            spec.load_hook()
            resolve_target(spec.target)


def install_hooks(specs: Sequence[HookSpec]) -> list[HookSpec]:
    """Register, apply and verify those of ``specs`` that apply to the installed SGLang (``ChangeNotes.where``);
    idempotent. Returns them. Raises PrfaasError on failure."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    pending: list[tuple[HookSpec, Callable]] = []
    specs = [spec for spec in specs if spec.applies()]
    for spec in specs:
        try:
            hook = spec.load_hook()
        except (ImportError, AttributeError) as err:
            raise PrfaasError(f"hook {spec.name}: cannot load {spec.hook}: {err}") from err
        try:
            current = resolve_target(spec.target)
        except (ImportError, AttributeError, ValueError) as err:
            raise PrfaasError(f"hook {spec.name}: target {spec.target} does not resolve: {err}") from err
        if reaches_hook(current, hook):
            continue
        HookRegistry.register(spec.target, hook, HookType(spec.hook_type))
        pending.append((spec, hook))
    if not pending:
        return specs
    HookRegistry.apply_hooks()
    failed = [spec for spec, hook in pending if not reaches_hook(resolve_target(spec.target), hook)]
    if failed:
        raise PrfaasError(
            "hooks did not take effect (see SGLang's 'Failed to apply hooks' log above): "
            + ", ".join(f"{s.name} -> {s.target}" for s in failed)
        )
    for spec, _ in pending:
        logger.info("prfaas_sglang: hook %s installed on %s", spec.name, spec.target)
    return specs


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def signature_drift(specs: Sequence[HookSpec | RegistrationSpec] = HOOKS + REGISTRATIONS) -> list[str]:
    """Targets (a hook's, or what a registered backend overrides) whose signature is none of those
    recorded for the supported releases (empty: none); a spec that does not apply to the installed
    SGLang is not checked."""
    drift = []
    for spec in (s for s in specs if s.applies()):
        pairs = spec.overrides if isinstance(spec, RegistrationSpec) else ((spec.target, spec.expected_signature),)
        for target_path, expected in pairs:
            accepted = (expected,) if isinstance(expected, str) else expected
            original = inspect.unwrap(resolve_target(target_path))
            found = _ADDRESS.sub("", str(inspect.signature(original)))  # a default that is a function
            if found not in accepted:
                drift.append(f"{target_path}: expected {' or '.join(accepted)}, found {found}")
    return drift


def install_registrations() -> None:
    """Register :data:`REGISTRATIONS` with SGLang's registries; idempotent. Raises PrfaasError."""
    from prfaas_sglang.hooks import cache_backend

    try:
        done = cache_backend.register_backends()
    except (RuntimeError, ValueError, KeyError, ImportError) as err:
        raise PrfaasError(f"registering backends: {err}") from err
    for name in done:
        logger.info("prfaas_sglang: backend %s registered", name)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group; see the module docstring."""
    from prfaas_sglang.patches import verify_installed

    try:
        require_supported(installed_sglang_version(), "this environment")
        verify_installed()  # the seams the hooks and backends call into (patches/series) are in place
        installed = install_hooks(HOOKS)
        install_registrations()
    except PrfaasError as err:
        raise HookInstallError(str(err)) from err
    report = envs.HOOK_REPORT.get()
    if report:  # one line per process that verified the hooks (O_APPEND: whole lines from concurrent processes)
        line = json.dumps({"pid": os.getpid(), "role": envs.ROLE.get(), "hooks": [spec.name for spec in installed],
                           "registered": [spec.name for spec in REGISTRATIONS]})
        with open(report, "a") as fh:
            fh.write(line + "\n")
