"""Every ``PRFAAS_*`` environment variable, in one place.

Values are read from ``os.environ`` each time ``.get()`` is called (nothing is
cached at import), so tests and launchers can set them per process. Code
outside this module never reads a ``PRFAAS_*`` variable directly.

Other projects' variables that we *set* (Mooncake's ``MC_*``, SGLang's
``SGLANG_*``) are not here: see ``prfaas_sglang.transport.wan_defaults`` and the
launcher.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prfaas_sglang.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return self.default if value is None or value == "" else value

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))

    def parse(self, parser: Callable[[str], T]) -> T | None:
        """The value read by ``parser``; None when unset. A ValueError from ``parser`` becomes a
        :class:`ConfigError` naming this variable (it stops a worker's startup)."""
        text = self.get()
        if text is None:
            return None
        try:
            return parser(text)
        except ValueError as err:
            raise ConfigError(self.name, str(err)) from None


def non_negative_int(text: str) -> int:
    """A parser for :meth:`EnvVar.parse`: a whole number >= 0 (ValueError otherwise)."""
    value = int(text)
    if value < 0:
        raise ValueError(f"must be a whole number >= 0, not {text!r}")
    return value


def seconds(text: str) -> float:
    """A parser for :meth:`EnvVar.parse`: a finite number of seconds >= 0 (ValueError otherwise)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a number of seconds >= 0, not {text!r}")
    return value


@dataclass(frozen=True)
class EnvBool(EnvVar):
    def get(self) -> bool:  # type: ignore[override]
        raw = super().get()
        return raw is not None and raw.strip().lower() in ("1", "true", "yes", "on")


class Envs:
    """The registry. ``envs.ROLE.get()``; ``Envs.all()`` lists every variable."""

    ROLE = EnvVar(
        "PRFAAS_ROLE",
        None,
        "Cluster role of this SGLang process (prfaas | pd-prefill | pd-decode), set by "
        "`python -m prfaas_sglang.launch`. When set, the plugin checks that SGLang's resolved "
        "server arguments honour the role and stops startup if they do not.",
    )
    KV_TRANSPORT = EnvVar(
        "PRFAAS_KV_TRANSPORT",
        None,
        "KV transport the launcher chose for this process (tcp | rdma); checked with PRFAAS_ROLE.",
    )
    ALLOW_SGLANG_VERSION = EnvVar(
        "PRFAAS_ALLOW_SGLANG_VERSION",
        None,
        "Let the plugin load into this SGLang version instead of the pinned one (rebase trials only).",
    )
    PATCHES_DIR = EnvVar(
        "PRFAAS_PATCHES_DIR",
        None,
        "Directory holding `series` and the patch files; default: the checkout's patches/ or the "
        "copy packaged in the wheel.",
    )
    WHEEL_CACHE = EnvVar(
        "PRFAAS_WHEEL_CACHE",
        None,
        "Where downloaded pristine SGLang wheels are kept; default ~/.cache/prfaas-sglang/wheels "
        "(the checkout's .cache/wheels when it exists).",
    )
    ADMIN_TOKEN = EnvVar(
        "PRFAAS_ADMIN_TOKEN",
        None,
        "Router: bearer token for /admin/*; unset disables the admin API (403).",
    )
    SKIP_PATCH_VERIFY = EnvBool(
        "PRFAAS_SKIP_PATCH_VERIFY",
        None,
        "Launcher: start SGLang even if the patch series is not applied (debugging only).",
    )

    HOOK_REPORT = EnvVar(
        "PRFAAS_HOOK_REPORT",
        None,
        "SGLang processes: after the plugin installed and verified every hook, append one JSON line "
        "{pid, role, hooks} to this file (the GPU check reads it: SGLang loads plugins before it "
        "configures logging, so the plugin's INFO lines are not printed). Unset: nothing written.",
    )
    POOL_REPORT = EnvVar(
        "PRFAAS_POOL_REPORT",
        None,
        "SGLang processes with the prfaas-hybrid cache backend: when the tree cache is built, append one "
        "JSON line {pid, kv_bytes_per_token, state_bytes_per_request, ...} measured on the engine's own "
        "pools to this file (bench profile reads it). Unset: nothing written.",
    )
    TELEMETRY_PORT = EnvVar(
        "PRFAAS_TELEMETRY_PORT",
        None,
        "PrfaaS prefill worker (SGLang): publish link telemetry (wire v4) on tcp://*:PORT; set by the "
        "launcher from the node's telemetry_port. Unset: no publisher.",
    )
    KV_LAYERWISE = EnvBool(
        "PRFAAS_KV_LAYERWISE",
        None,
        "PrfaaS prefill worker (SGLang, with PRFAAS_KV_ASYNC_SEND): send each layer's KV of the chunk "
        "being prefilled as soon as the forward wrote it, instead of the whole chunk after the forward "
        "(the kv-layerwise hooks). Off by default; linear and SWA state still go once at the end.",
    )
    DECODE_CONTIGUOUS_KV = EnvBool(
        "PRFAAS_DECODE_CONTIGUOUS_KV",
        None,
        "PD decode worker (SGLang, page size 1): pre-allocate each prompt's KV as one run of consecutive "
        "free slots where the pool has one (best fit), so SGLang's Mooncake sender writes one request per "
        "layer instead of one per hole left by finished decodes (the decode-contiguous-kv hook). Set by "
        "the launcher for the pd-decode role (0 turns it off).",
    )
    KV_ASYNC_SEND = EnvBool(
        "PRFAAS_KV_ASYNC_SEND",
        None,
        "PrfaaS prefill worker (SGLang): submit each chunk's KV as asynchronous writes (adjacent "
        "entries merged) and wait, sleeping, only before the last chunk's aux, instead of one "
        "busy-waiting synchronous batch per chunk (the kv-send hooks). Set by the launcher for the "
        "prfaas role (0 turns it off). The emulated engine's prefill sends through the same sender "
        "when this is set, and where it is unset in the prfaas role; 0 makes it send SGLang's way.",
    )
    KV_STAGING_MIB = EnvVar(
        "PRFAAS_KV_STAGING_MIB",
        None,
        "PrfaaS prefill worker (SGLang, with PRFAAS_KV_ASYNC_SEND): MiB of a staging buffer on the KV's "
        "device, registered with the transfer engine. A chunk's KV pages that are scattered on the prefill "
        "side but contiguous on the decode side are gathered into it and sent as one write per "
        "destination run (transport/kv_stager.py); runs it has no room for go as they are. Set by the "
        "launcher for the prfaas role; 0 turns it off; a malformed value stops startup.",
    )
    DECODE_STAGING_TOKENS = EnvVar(
        "PRFAAS_DECODE_STAGING_TOKENS",
        None,
        "PD decode worker (SGLang, Mooncake): tokens of KV pool set aside at startup as one run (the "
        "reserve, at most an eighth of the pool). A prompt whose pages are scattered receives its KV "
        "there in one run and has it copied to its own pages once it landed (hooks/decode_stage.py), "
        "so the prefill writes one request per KV buffer instead of one per run. Set by the launcher "
        "for the pd-decode role; 0 turns it off; a malformed value stops startup.",
    )
    KV_KEEPALIVE = EnvVar(
        "PRFAAS_KV_KEEPALIVE",
        None,
        "SGLang worker whose KV crosses the WAN link: TCP keepalive on its Mooncake connections, as "
        "'idle_s,interval_s,probes' (the kv-lane-keepalive hook). Ends the receiver's sessions of lanes "
        "the sender closed while the link was dark, and keeps idle lanes' NAT entries. Set by the "
        "launcher for the prfaas and pd-decode roles; a malformed value stops startup.",
    )
    KV_LANE_PACING = EnvVar(
        "PRFAAS_KV_LANE_PACING",
        None,
        "PrfaaS prefill worker (SGLang, with PRFAAS_KV_ASYNC_SEND): the WAN link as 'rate_bps,rtt_s[,headroom]'. "
        "While a batch of equal large writes is all in flight, one per lane, each lane is paced at an "
        "equal share of the rate plus headroom (default 0.05: 5%), so the lanes end together "
        "(transport/lane_pacing.py). Set by "
        "the launcher for the prfaas role where the topology states the link; a malformed value stops "
        "startup. The emulated engine's PrfaaS worker also sizes its writes from the rate.",
    )
    POLL_WAIT_MS = EnvVar(
        "PRFAAS_POLL_WAIT_MS",
        None,
        "SGLang worker: after a loop iteration that ran no batch, its scheduler waits up to this many "
        "milliseconds for a request on its input sockets instead of polling again at once (the "
        "scheduler-poll-wait hook). For servers that share a machine's CPU cores: a PD server with a request "
        "in flight otherwise spins a whole core while it waits for KV or a bootstrap. Unset (SGLang's busy "
        "poll) unless the CPU harness or the test suite sets it; a malformed value stops the scheduler.",
    )
    PREFILL_CACHE = EnvVar(
        "PRFAAS_PREFILL_CACHE",
        None,
        "SGLang prefill worker with the prfaas-hybrid cache backend: which finished prefills its radix "
        "tree keeps (kvindex/admission.py): all | shared | auto | none. Unset: SGLang's behaviour "
        "(all). shared: one-off long prompts are transfer cache, freed once sent; a prefix seen "
        "twice is kept. auto (the launcher's default for the prfaas role): shared, but one-off "
        "prompts are kept too while most returning prefixes come back within the cache's reach.",
    )
    PREFILL_CACHE_MIN_SHARED_TOKENS = EnvVar(
        "PRFAAS_PREFILL_CACHE_MIN_SHARED_TOKENS",
        "1024",
        "With PRFAAS_PREFILL_CACHE=shared: the shortest prefix (tokens) that counts as shared.",
    )
    STATE_CHECKPOINTS = EnvVar(
        "PRFAAS_STATE_CHECKPOINTS",
        "chunks",
        "SGLang worker with the prfaas-hybrid cache backend: where a hybrid model's linear-state "
        "checkpoints are taken during a prefill: chunks (SGLang's: every chunk boundary and the "
        "end) or end (the request's end only; each checkpoint is a state slot, ~74 MiB for "
        "Qwen3-Next-80B).",
    )
    BIND_SHIM = EnvVar(
        "PRFAAS_BIND_SHIM",
        "auto",
        "Launcher, engine nodes with a host: preload the bind shim (prfaas_sglang/native/bindshim.c) "
        "so Mooncake's listeners bind the node's address instead of all interfaces: auto (when it "
        "can be built, else a note), require (refuse to start without it), off.",
    )
    BIND_HOST = EnvVar(
        "PRFAAS_BIND_HOST",
        None,
        "Read by the bind shim (C) in an engine process, set by the launcher: the address a wildcard "
        "bind to a port in PRFAAS_BIND_PORTS becomes.",
    )
    BIND_PORTS = EnvVar(
        "PRFAAS_BIND_PORTS",
        None,
        "Read by the bind shim (C), set by the launcher: LO-HI[,LO-HI...], the ports whose wildcard "
        "binds are rewritten (Mooncake's MC_MIN_RPC_PORT..MC_MAX_RPC_PORT).",
    )
    NATIVE_DIR = EnvVar(
        "PRFAAS_NATIVE_DIR",
        None,
        "Where native helpers are built (default ~/.cache/prfaas-sglang/native); engine images "
        "build them there ahead of time.",
    )
    SECRET_FILE = EnvVar(
        "PRFAAS_SECRET_FILE",
        None,
        "Every process of a deployment: a file holding the deployment secret (>= 16 bytes; e.g. "
        "a mounted Kubernetes Secret). Set, it turns on authentication (prfaas_sglang/security.py): "
        "workers demand an API key derived from it, hand-offs between workers are signed, ZMQ "
        "KV-event and telemetry streams use CURVE. Unset: no authentication (a warning at start).",
    )
    PEER_HOSTS = EnvVar(
        "PRFAAS_PEER_HOSTS",
        None,
        "Engine workers: comma-separated hosts a worker may hand KV to or take it from (bootstrap "
        "hosts, notify and import URLs); set by the launcher from the topology. Unset: any host.",
    )
    ROLE_SWITCH_STARTUP_S = EnvVar(
        "PRFAAS_ROLE_SWITCH_STARTUP_S",
        "900",
        "Role supervisor (a node with role_switch: restart): how long an engine restarted in its other PD role "
        "may take to answer /health 200 before the node is declared unhealthy (restart required).",
    )
    TUNNEL_WAIT_S = EnvVar(
        "PRFAAS_TUNNEL_WAIT_S",
        "0",
        "A node on an encrypted link: how long it waits for its host's tunnel (launch --tunnel, a container in "
        "its pod on Kubernetes) to come up before refusing to start; launch --tunnel: how long it waits for its "
        "peers' names to resolve. 0: refuse at once.",
    )
    TUNNEL_RESOLVE_S = EnvVar(
        "PRFAAS_TUNNEL_RESOLVE_S",
        "5",
        "launch --tunnel, where the topology's hosts are names (Kubernetes pods): how often it resolves its "
        "peers again, to follow one recreated at a new address.",
    )
    PORT_RANGE = EnvVar(
        "PRFAAS_PORT_RANGE",
        None,
        "Local tools that start servers (demo, benchmarks, tests): the loopback ports they pick from, "
        "as 'low-high' (high exclusive). Default: from 20000 up to the kernel's ephemeral range. "
        "The test suite gives each parallel worker a slice of its own.",
    )
    TRACE_PATH = EnvVar(
        "PRFAAS_TRACE_PATH",
        None,
        "Tests and examples: the Mooncake conversation trace (JSONL) to replay; default "
        "../shared/data/mooncake_conversation_trace.jsonl beside the checkout.",
    )
    TEST_REPORT = EnvVar(
        "PRFAAS_TEST_REPORT",
        None,
        "The test suite (tests/conftest.py): a JSONL file each test's duration, outcome and group is "
        "appended to, for the report `make test` prints at its end (scripts/test_report.py).",
    )
    TEST_SERIAL_PLAN = EnvVar(
        "PRFAAS_TEST_SERIAL_PLAN",
        None,
        "The test suite (tests/conftest.py): a directory where a session writes the files of the tests "
        "marked serial it collected, as `alone` (those of the real-SGLang deployment's group, one after "
        "another) and `beside` (the light ones, which run beside each other); scripts/run-tests.sh waits "
        "for them and runs the serial phases on them beside the others.",
    )

    @classmethod
    def all(cls) -> list[EnvVar]:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]


envs = Envs()
