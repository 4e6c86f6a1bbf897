"""``python -m prfaas_sglang.bench gpu-e2e --bundle DIR``: real SGLang behind our router, on one GPU.

Starts, through our launcher only, a PrfaaS prefill server, a PD prefill, a PD decode, the
kv-index and the router (one topology, loopback, every server on the one GPU), plus a plain
SGLang server (role ``single``) as the reference, then runs the checks:

    hooks         every hook installed in every SGLang server; a deliberately broken hook stops
                  a server's start-up with a message naming it
    greedy-equal  greedy outputs through the router equal the reference's, token for token:
                  short prompts (PD-P) and long ones up to 32K tokens (PrfaaS, KV over Mooncake
                  TCP), /v1/completions and /v1/chat/completions, streamed and not
    routing       each request lands where the threshold says (route header, router counters),
                  and the engines' own request counters agree
    kv-index      the kv-index's predicted reusable length equals the engine's cached_tokens
                  for repeated and extended prompts, and the extension hits
    cache-move    a prefix cached on PD-P only is moved to the PrfaaS server through the cache-move
                  routes (Mooncake TCP between real servers); the kv-index sees it stored there and
                  a longer prompt routed there reuses it
    state-events  both prefill servers report their Mamba state checkpoints (issue #15); the
                  PrfaaS server inserts no one-off long prompt and reuses one sent three times
    failover      the PrfaaS server is killed mid-run: every request completes via PD-P or fails
                  with a clear error before any token; none hangs; the router reports it
    shaped-link   PrfaaS in a network namespace behind a rate-shaped veth (pyroute2, netlink):
                  TTFT at 8K and 32K tokens, SGLang's Mooncake settings, our WAN profile, and
                  our WAN profile with layer-wise streaming (PRFAAS_KV_LAYERWISE=1); outputs
                  identical to the unshaped run
    role-switch   (SGLang 0.5.23, CPU) the router turns a PD prefill worker into decode and back
                  through SGLang's own /pd_role_switch under light load; no request lost

Every process runs in its own process group (``demo.cluster.ProcessGroup``, the one harness) and
every group is killed on the way out (failure, Ctrl-C and SIGTERM included): SGLang's scheduler and
detokenizer outlive a killed parent.

Pure helpers (prompt making, output comparison, the topology, the summary) are at the top and
unit-tested without a GPU; then the bundle, the deployment and the plain server. The checks and
the run that does them are in ``gpu/checks.py``, which imports this module (never the other way).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup, free_port
from prfaas_sglang.plan.workload import case_study_lengths

CHECKS = ("hooks", "greedy-equal", "routing", "kv-index", "cache-move", "state-events", "failover", "shaped-link",
          "role-switch")
CHECK_ALIASES = {"wan-profile": "shaped-link"}  # issue #14's name for it: TTFT of the WAN profile over the shaped link
# Flags every SGLang server gets (shared/notes/gpu.md): paths a slimmed sglang-kernel has, random
# weights with one seed (greedy outputs then compare across servers), cached_tokens reported.
# Pools of a fixed size: SGLang sizes them from the memory free at its profiling step less a share
# of what was free before its model loaded, so servers starting together on one GPU see each
# other's pools appear in between and fail (seen on the H200, 2026-11-26: "max_mamba_cache_size=-815").
# A high fraction leaves that difference positive; the caps set what is allocated (KV for 512K
# tokens of the tiny model is 256 MiB; 128 Mamba slots, 50 MB).
SERVER_FLAGS = ("--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--grammar-backend", "none", "--disable-cuda-graph", "--random-seed", "0", "--enable-cache-report",
                "--mem-fraction-static", "0.6", "--max-total-tokens", "524288", "--max-mamba-cache-size", "128",
                "--max-running-requests", "32", "--log-level", "info")
THRESHOLD_TOKENS = 4096  # pinned through the admin API: shorter prompts to PD-P, longer to PrfaaS
SHORT_TOKENS = (64, 1024)
LONG_TOKENS = (8192, 32768)
MAX_NEW_TOKENS = 16
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 300.0
SHAPED_RATE_MBIT = 200.0  # binds for a 32K prompt's KV on the tiny model, lets an 8K one pass in a second
SHAPED_RTT_MS = 1.0  # what the topology states for the bare veth: it has no delay
# The WAN round trip the issue names, added with netem on the veth's host end where the kernel has it
# (not this dev machine's): the same deployments are timed again with it.
SHAPED_DELAY_RTT_MS = 20.0
SHAPED_STARTUP_TIMEOUT_S = 300.0
SHAPED_REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ServerProfile:
    """What every SGLang server of a run gets and how long its prompts are: on the GPU machine
    (:data:`GPU_PROFILE`, the tiny hybrid) or real SGLang on CPU (:data:`CPU_PROFILE`, a tiny Llama:
    SGLang's CPU engine serves plain attention with torch's kernels, and lengths a 2-core machine
    prefills in seconds)."""

    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    threshold_tokens: int = THRESHOLD_TOKENS
    short_tokens: tuple[int, ...] = SHORT_TOKENS
    long_tokens: tuple[int, ...] = LONG_TOKENS
    served_name: str = "tiny-hybrid"
    # The topology's cost model: its attention kinds tell the kv-index whether prefix reuse stops at
    # state checkpoints (hybrid) or not; it must match the served model's (a dense model under a
    # hybrid cost model: the index predicts no reuse where SGLang reuses the whole prefix). None: the
    # served model's own config.json (plan.hf), so the router's KV bytes are what the servers ship.
    cost_model: str | None = "kimi-linear-1t-hybrid"
    router_args: tuple[str, ...] = ()  # the router's own flags (after the launcher's ``--``)
    shaped_repeats: int = 5  # shaped-link's timed prompts per length, link and profile, each a fresh one (no cache hit)
    on_cpu: bool = False  # SGLang's CPU engine

    def pd_flags(self, decodes: bool) -> tuple[str, ...]:
        """What a disaggregated server gets beyond :attr:`flags` on the installed SGLang (``decodes``: it
        decodes, or may become a decode server). On CPU, where that SGLang takes a CUDA-only path by
        default: no overlap scheduler where a prefill's early send records a CUDA event
        (``_compat.overlap_early_send_records_cuda_event``), and, to decode, retracted requests backed by
        CPU tensors, not a CUDA-registered host pool (``_compat.decode_retraction_backup_pins_host_memory``);
        both 0.5.23."""
        from prfaas_sglang import _compat

        if not self.on_cpu:
            return ()
        flags: tuple[str, ...] = ()
        if _compat.overlap_early_send_records_cuda_event():
            flags += ("--disable-overlap-schedule",)
        if decodes and _compat.decode_retraction_backup_pins_host_memory():
            flags += ("--disaggregation-decode-retraction-backup", "cpu_tensor")
        return flags


# SGLang's /health answers 503 once its scheduler has said nothing for SGLANG_HEALTH_CHECK_TIMEOUT (20 s),
# and the router takes a worker out at once on a 503. A slow forward must be a late answer (a miss the
# router tolerates) instead: a first forward on the GPU compiles Triton kernels for ~60 s (H200,
# 2026-11-26); a server's first CPU prefill took 33 s, and the next long prompt went to PD-P.
SGLANG_HEALTH_WAIT = ("SGLANG_HEALTH_CHECK_TIMEOUT", "120")
GPU_PROFILE = ServerProfile(SERVER_FLAGS, env=(SGLANG_HEALTH_WAIT,))
# The CPU engine sizes its pool from the memory free before and after its model loaded, like the GPU's:
# with five servers loading at once (the reference and the broken-hook one beside the deployment), 0.05
# left "no memory for the KV cache" (2026-11-27, others' imports took 5.3% meanwhile), and 0.15 in a fresh
# run whose parallel phase was packed tighter (2026-11-30: 16.35% taken meanwhile, the 0.5.23 leg's
# deployment did not start); 0.4 tolerates others taking 40%. The pool is capped by --max-total-tokens
# either way (65,536 tokens, 256 MiB of the tiny Llama's KV).
# --sleep-on-idle: an idle scheduler otherwise polls its sockets without pause, a whole core each (measured
# 2026-11-29: 10.1 CPU-s in 10 s idle, 0.1 with it); four or five servers on two cores starved the one that
# worked, which spread identical requests' TTFTs tenfold. It sleeps only when fully idle (no request in any
# queue, PD's included) and wakes on the tokenizer's socket. PRFAAS_POLL_WAIT_MS (the scheduler-poll-wait
# hook) covers the rest: a PD server with a request in flight but nothing to run (a decode waiting for its KV)
# spun a core beside the prefill it waited for (1.98 CPU-s in a 1.94 s PrfaaS prefill, 2026-11-30); it now
# waits 5 ms at a time on its sockets.
CPU_POLL_WAIT = ("PRFAAS_POLL_WAIT_MS", "5")
CPU_PROFILE = ServerProfile(
    ("--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
     "--sampling-backend", "pytorch",
     "--grammar-backend", "none", "--disable-cuda-graph", "--random-seed", "0", "--enable-cache-report",
     "--mem-fraction-static", "0.4", "--max-total-tokens", "65536", "--max-running-requests", "8",
     "--chunked-prefill-size", "2048", "--sleep-on-idle", "--log-level", "info"),
    env=(("SGLANG_USE_CPU_ENGINE", "1"), SGLANG_HEALTH_WAIT, CPU_POLL_WAIT),  # SGLang outwaits the router's two 30 s misses
    threshold_tokens=1024, short_tokens=(64, 512), long_tokens=(2048, 4096),
    # The tiny Llama's own: 4 KiB of KV per token. A catalog model's (Qwen3-235B: 188 KiB) made the router
    # reckon 48 times the bytes each prompt really ships, so no probe of a constrained link ever fit.
    served_name="tiny-llama", cost_model=None,
    # SGLang's /health generates a token, queued behind the prefill running: on two cores a 4,096-token
    # prompt prefills for 5-10 s, and two 5 s misses took the PrfaaS server out of routing mid-check
    router_args=("--health-timeout-s", "30"),
    shaped_repeats=3,  # a CPU prefill of 4,096 tokens takes seconds
    on_cpu=True)
# ``--engine sglang-cpu``: real SGLang on CPU. Not state-events: it needs a hybrid, and SGLang (0.5.15 and 0.5.23)
# serves one on CPU only where the CPU has AMX (BENCHMARKS.md, "state-events on CPU: a hybrid needs AMX")
CPU_CHECKS = ("hooks", "greedy-equal", "routing", "kv-index", "cache-move", "failover", "shaped-link", "role-switch")
CPU_WITHOUT = {"state-events": "it needs a hybrid model, and SGLang serves one on CPU only where the CPU has AMX "
                               "(its gated RMSNorm runs sgl_kernel's CPU kernel there, else Triton, which has no CPU "
                               "driver); run it on the GPU machine"}
# role-switch needs SGLang's own /pd_role_switch (0.5.23; the GPU bundle's 0.5.15 has none) and a second,
# switchable PD prefill in the deployment


def default_checks(engine: str) -> tuple[str, ...]:
    """What ``bench gpu-e2e`` runs when no ``--checks`` are given: every check of ``engine`` the SGLang
    it runs can pass (role-switch only where that SGLang serves /pd_role_switch)."""
    from prfaas_sglang._compat import serves_pd_role_switch

    checks = MOCK_CHECKS if engine == "mock" else CPU_CHECKS if engine == "sglang-cpu" else CHECKS
    return tuple(c for c in checks if c != "role-switch" or (engine == "sglang-cpu" and serves_pd_role_switch()))


NEED_REFERENCE = {"hooks", "greedy-equal", "shaped-link"}  # the plain server: its hook report, its answers


def profile_for(engine: str) -> ServerProfile:
    return CPU_PROFILE if engine == "sglang-cpu" else GPU_PROFILE


# ``--engine mock``: the harness's own dry run on CPU (emulated engines, no reference server):
# what it checks is the harness (namespaces, launcher, router, timing), not SGLang.
MOCK_CHECKS = ("shaped-link", "routing", "kv-index", "failover")  # state-events: SGLang's cache reports, not emulated
MOCK_EMULATION = {"speedup": 10.0, "kv_scale": 0.01}


# --- pure helpers ------------------------------------------------------------------------------


@dataclass
class CheckResult:
    name: str
    ok: bool
    reason: str = ""
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"PASS {self.name}" if self.ok else f"FAIL {self.name}: {self.reason}"


def gpu_unavailable(dev_dir: Path = Path("/dev")) -> str | None:
    """Why this machine cannot run the check (one line), or None: an NVIDIA device node is needed."""
    if not (dev_dir / "nvidiactl").exists() and not any(dev_dir.glob("nvidia[0-9]*")):
        return "no NVIDIA GPU on this machine (no /dev/nvidia*); run it on the lent GPU machine (docs/real-sglang.md)"
    return None


def prompt_ids(num_tokens: int, vocab_size: int, seed: int, first_id: int = 16) -> list[int]:
    """A deterministic prompt of ``num_tokens`` ordinary token ids (specials, the first ``first_id``, avoided)."""
    rng = random.Random(seed)
    return [rng.randrange(first_id, vocab_size) for _ in range(num_tokens)]


def extended(ids: list[int], more: int, vocab_size: int, seed: int) -> list[int]:
    return ids + prompt_ids(more, vocab_size, seed)


def request_cases(vocab_size: int, profile: ServerProfile = GPU_PROFILE) -> list[dict]:
    """The greedy-equal cases: every length x endpoint x streaming. Completions take the prompt as
    ids; chat takes text decoded from ids (the router tokenizes it with the chat template)."""
    cases = []
    for num_tokens in profile.short_tokens + profile.long_tokens:
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            for stream in (False, True):
                label = "chat" if "chat" in endpoint else "completions"
                cases.append({"name": f"{label}-{num_tokens}{'-stream' if stream else ''}",
                              "endpoint": endpoint, "num_tokens": num_tokens, "stream": stream,
                              "seed": num_tokens, "long": num_tokens >= profile.threshold_tokens})
    return cases


def request_body(case: dict, ids: list[int], text: str | None, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "stream": case["stream"]}
    if case["endpoint"] == "/v1/completions":
        body["prompt"] = ids
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if case["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def parse_answer(endpoint: str, stream: bool, payload: bytes) -> dict:
    """``{"text", "finish_reason", "cached_tokens", "prompt_tokens"}`` from an OpenAI-format answer
    (a JSON body, or an SSE stream of chunks)."""
    kind = "text" if endpoint == "/v1/completions" else "content"
    if not stream:
        obj = json.loads(payload)
        choice = obj["choices"][0]
        text = choice.get("text") if kind == "text" else (choice.get("message") or {}).get("content")
        usage = obj.get("usage") or {}
        return {"text": text or "", "finish_reason": choice.get("finish_reason"),
                "cached_tokens": _cached_tokens(usage), "prompt_tokens": usage.get("prompt_tokens")}
    parts, finish, usage = [], None, {}
    for line in payload.decode().splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        obj = json.loads(line[5:])
        if "error" in obj:
            raise ValueError(f"stream error: {obj['error']}")
        for choice in obj.get("choices") or ():
            piece = choice.get("text") if kind == "text" else (choice.get("delta") or {}).get("content")
            parts.append(piece or "")
            finish = choice.get("finish_reason") or finish
        usage = obj.get("usage") or usage
    return {"text": "".join(parts), "finish_reason": finish,
            "cached_tokens": _cached_tokens(usage), "prompt_tokens": usage.get("prompt_tokens")}


def _cached_tokens(usage: dict) -> int | None:
    """The answer's reused prompt tokens; None where it reports no usage. SGLang (with
    ``--enable-cache-report``) leaves ``prompt_tokens_details`` out when nothing was reused
    (``usage_processor``: details only for a count above 0), so usage without it means 0."""
    if usage.get("prompt_tokens") is None:
        return None
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def output_mismatch(ours: dict, reference: dict) -> str | None:
    """Why two answers differ (None: the same text and finish reason)."""
    if ours["text"] != reference["text"]:
        return f"text {ours['text']!r} != reference {reference['text']!r}"
    if ours["finish_reason"] != reference["finish_reason"]:
        return f"finish_reason {ours['finish_reason']} != reference {reference['finish_reason']}"
    return None


def pd_prefill_names(switchable: bool) -> tuple[str, ...]:
    """The PD prefill nodes of :func:`e2e_topology`: two where one may turn into decode (the router never
    converts the last of a role), else one."""
    return ("pd-prefill-0", "pd-prefill-1") if switchable else ("pd-prefill-0",)


def served_cost_model(model_dir: Path, name: str) -> dict:
    """The topology's ``model.cost_model`` mapping for the model in ``model_dir`` (its ``config.json``)."""
    from prfaas_sglang.plan.hf import model_from_hf_config
    from prfaas_sglang.plan.scenario import model_mapping

    return model_mapping(model_from_hf_config(json.loads((model_dir / "config.json").read_text()), name))


def e2e_topology(model_dir: Path, ports: Callable[[], int], host: str = "127.0.0.1",
                 prfaas_host: str | None = None, link: tuple[float, float] = (1.0, 20.0),
                 emulation: dict | None = None, profile: ServerProfile = GPU_PROFILE, switchable: bool = False) -> dict:
    """The topology the check starts: one PrfaaS node, one PD prefill, one PD decode, router and
    kv-index, the model's tokenizer in the router, every SGLang server with ``profile``'s flags;
    ``link`` = (Gbit/s, RTT ms) stated for PrfaaS -> PD (the WAN profile is sized from it). With
    ``switchable`` (the role-switch check): a second PD prefill, both ``role_switch: in-place``."""
    def engine(name: str, role: str, prefill: bool, at: str = host) -> dict:
        node = {"name": name, "role": role, "host": at, "port": ports(), "kv_events_port": ports()}
        if prefill:
            node["bootstrap_port"] = ports()
        if role == "prfaas":
            node["telemetry_port"] = ports()
        if role == "pd-prefill" and switchable:
            node["role_switch"] = "in-place"
        if flags := profile.pd_flags(decodes=role == "pd-decode" or "role_switch" in node):
            node["extra_args"] = list(flags)
        return node

    doc = {
        "version": 1,
        "model": {"path": str(model_dir), "served_name": profile.served_name, "tokenizer": str(model_dir),
                  "cost_model": profile.cost_model or served_cost_model(model_dir, profile.served_name),
                  "extra_args": list(profile.flags)},
        "clusters": {
            "prfaas-b": {"kind": "prfaas", "kv_transport": "tcp", "accelerator": "h200x8",
                         "nodes": [engine("prfaas-0", "prfaas", True, prfaas_host or host)]},
            "pd-a": {"kind": "pd", "kv_transport": "tcp", "accelerator": "h20x8",
                     "nodes": [engine(name, "pd-prefill", True) for name in pd_prefill_names(switchable)]
                     + [engine("pd-decode-0", "pd-decode", False)]},
            "control": {"kind": "control", "nodes": [{"name": "router", "role": "router", "host": host, "port": ports()},
                                                     {"name": "kv-index", "role": "kv-index", "host": host, "port": ports()}]},
        },
        "links": [{"from": "prfaas-b", "to": "pd-a", "bandwidth_gbps": link[0], "rtt_ms": link[1]}],
        "scheduler": {"workload": case_study_lengths(40960).config(),
                      "output_tokens": MAX_NEW_TOKENS, "slo_tokens_per_s": 1, "ttft_slo_s": 600},
    }
    if emulation is not None:  # emulated engines (the dry run): how they scale time and KV bytes
        doc["emulation"] = dict(emulation)
    return doc


def summary(results: Iterable[CheckResult], facts: dict) -> dict:
    results = list(results)
    return {"ok": bool(results) and all(r.ok for r in results), "passed": [r.name for r in results if r.ok],
            "failed": {r.name: r.reason for r in results if not r.ok}, "checks": {r.name: r.data for r in results},
            **facts}


def hook_report(work: Path, server: str) -> Path:
    """Where ``server``'s SGLang processes record the hooks they verified (``PRFAAS_HOOK_REPORT``)."""
    return work / f"hooks-{server}.jsonl"


def hook_report_problems(lines: list[str], hooks: list[str], min_processes: int = 2) -> list[str]:
    """What a server's hook report lacks (pure): at least ``min_processes`` processes (the HTTP
    server's and the scheduler's), each having verified every hook."""
    problems, pids = [], set()
    for line in lines:
        try:
            entry = json.loads(line)
            pid, verified = entry["pid"], entry["hooks"]
        except (ValueError, KeyError, TypeError):
            problems.append(f"unreadable report line {line[:80]!r}")
            continue
        pids.add(pid)
        if missing := sorted(set(hooks) - set(verified)):
            problems.append(f"process {pid} did not verify {missing}")
    if len(pids) < min_processes:
        problems.append(f"{len(pids)} process(es) reported, at least {min_processes} expected")
    return problems


def broken_hook_site(directory: Path) -> Path:
    """A directory whose ``sitecustomize`` adds a hook with a target that does not resolve: put first
    on PYTHONPATH, every SGLang process of a server then loads it with our plugin."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "import dataclasses\n"
        "from prfaas_sglang import plugin\n"
        "plugin.HOOKS = (*plugin.HOOKS, dataclasses.replace(plugin.HOOKS[0], name='deliberately-broken',\n"
        "                target='sglang.srt.server_args.ServerArgs.no_such_method_prfaas'))\n")
    return directory


# --- the bundle on the GPU machine --------------------------------------------------------------


def unpack(bundle_dir: Path) -> Path:
    """The bundle's root (``site/`` and ``model/`` inside): ``bundle_dir`` itself when already
    unpacked, else ``bundle.tar.xz`` unpacked beside it (once)."""
    if (bundle_dir / "site").is_dir():
        return bundle_dir
    archive = bundle_dir / "bundle.tar.xz"
    if not archive.is_file():
        raise FileNotFoundError(f"{bundle_dir}: neither site/ nor bundle.tar.xz (build it: bench gpu-bundle --out DIR)")
    root = bundle_dir / "unpacked"
    if not (root / "site").is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return root


IMPORT_ONLY_DIR = Path(__file__).resolve().parent / "import_only"  # an sgl_kernel whose every kernel raises


def needs_import_only_sgl_kernel() -> bool:
    """Whether real SGLang servers on this CPU need :data:`IMPORT_ONLY_DIR`: the SGLang this process runs
    imports ``sgl_kernel``'s CPU build under its CPU engine (``_compat.cpu_engine_imports_sgl_kernel``, 0.5.23)
    and no ``sgl_kernel`` is installed (PyPI has no CPU build)."""
    import importlib.util

    from prfaas_sglang._compat import cpu_engine_imports_sgl_kernel

    return cpu_engine_imports_sgl_kernel() and importlib.util.find_spec("sgl_kernel") is None


def bundle_env(root: Path | None, checkout: Path, base: dict[str, str] | None = None,
               profile: ServerProfile = GPU_PROFILE) -> dict[str, str]:
    """The environment every process gets: the checkout, then the bundle's site, on PYTHONPATH (on CPU,
    ``root`` None: no bundle, and this shell's own PYTHONPATH after the checkout, so the servers run the
    SGLang this process runs, an overlay of another release included: ``make test-sglang``; last, where
    :func:`needs_import_only_sgl_kernel`, :data:`IMPORT_ONLY_DIR`); no hub
    access; none of this shell's PRFAAS_* or MC_* settings; ``profile``'s variables."""
    base = base if base is not None else os.environ
    env = {k: v for k, v in base.items() if not k.startswith(("PRFAAS_", "MC_"))}
    after = [str(root / "site")] if root is not None else [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root is None and needs_import_only_sgl_kernel():
        after.append(str(IMPORT_ONLY_DIR))
    env["PYTHONPATH"] = os.pathsep.join([str(checkout)] + after)
    # SGLang's own flashinfer paths off too (the bundle carries no flashinfer JIT sources; bundle.REWRITES)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", SGLANG_IS_FLASHINFER_AVAILABLE="false")
    env.update(profile.env)
    return env


# --- HTTP ----------------------------------------------------------------------------------------


def http(method: str, url: str, body: dict | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of any answer, ``body`` sent as JSON; raises
    :class:`~prfaas_sglang.adapters.http_sync.HttpError` (an OSError) when none came."""
    answer = http_sync.request(method, url, timeout_s=timeout_s, json_body=body, headers=headers)
    return answer.status, dict(answer.headers), answer.body


def unroutable(status: dict) -> list[str]:
    """The workers a router's ``/status`` body shows it would not route to now (pure): down, refused,
    draining, or with the link to them marked down; ``[]`` when every one is routable."""
    down = set(status.get("link_down_workers") or ())
    return sorted(name for name, w in (status.get("workers") or {}).items()
                  if not w.get("healthy") or w.get("refused") or w.get("draining") or name in down)


def wait_routable(router: str, timeout_s: float = 60.0) -> float:
    """Poll the router's ``/status`` until :func:`unroutable` is empty; the seconds waited. A worker's
    first forward (Triton JIT on a GPU) can outlast the router's health timeout, and a timed request
    sent while the router holds that worker down would measure the other cluster. Raises
    RuntimeError naming the workers still unroutable after ``timeout_s``."""
    started, left = time.monotonic(), ["?"]
    while time.monotonic() - started < timeout_s:
        try:
            status, _, body = http("GET", router + "/status", timeout_s=5)
            if status == 200 and not (left := unroutable(json.loads(body))):
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router still holds {left} unroutable after {timeout_s:g} s")


def metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total


# --- the run --------------------------------------------------------------------------------------

ADMIN_TOKEN = "gpu-e2e"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # the router's admin API, as the harness calls it


@dataclass
class RunningDeployment:
    topology: dict
    config: Path
    env: dict[str, str]
    procs: ProcessGroup
    work: Path
    prfaas_argv: list[str]  # the PrfaaS server's launch, without its ``--kv-profile``
    prfaas_env: dict[str, str]  # its environment, without a profile's own variables
    prfaas_preexec: Callable[[], None] | None = None
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    prfaas_profile: tuple[str, tuple[tuple[str, str], ...]] = ("wan", ())  # (kv profile, extra env) running now
    restarts: int = 0

    def node(self, name: str) -> dict:
        for cluster in self.topology["clusters"].values():
            for node in cluster["nodes"]:
                if node["name"] == name:
                    return node
        raise KeyError(name)

    def engines(self, role: str | None = None) -> list[str]:
        """The SGLang servers of the deployment (``role``: of that topology role only), in topology order."""
        return [node["name"] for cluster in self.topology["clusters"].values() for node in cluster["nodes"]
                if node["role"] not in ("router", "kv-index") and role in (None, node["role"])]

    def url(self, name: str) -> str:
        node = self.node(name)
        return f"http://{node['host']}:{node['port']}"

    def start_prfaas(self, kv_profile: str, env: dict[str, str] | None = None) -> None:
        """Start ``prfaas-0`` with ``kv_profile`` and ``env`` added to its own environment (not waited for)."""
        self.procs.start("prfaas-0", [*self.prfaas_argv, "--kv-profile", kv_profile], env,
                         base_env=self.prfaas_env, preexec_fn=self.prfaas_preexec)
        self.prfaas_profile = (kv_profile, tuple(sorted((env or {}).items())))

    def restart_prfaas(self, kv_profile: str, env: dict[str, str] | None = None) -> float:
        """Stop ``prfaas-0`` alone and start it again with ``kv_profile`` and ``env`` (the PD servers,
        the kv-index and the router keep running: a profile switch costs one server's start, not a
        deployment's); the seconds until it is healthy and the router routes to every worker again.
        Its previous log is kept as ``prfaas-0.{n}.log``."""
        started = time.monotonic()
        self.procs.stop(["prfaas-0"])
        log = self.procs.log_dir / "prfaas-0.log"
        if log.exists():
            log.rename(self.procs.log_dir / f"prfaas-0.{self.restarts}.log")
        self.restarts += 1
        self.start_prfaas(kv_profile, env)
        self.procs.wait_healthy(self.url("prfaas-0") + "/health", self.procs.latest("prfaas-0"),
                                timeout_s=self.startup_timeout_s)
        wait_routable(self.url("router"))
        return time.monotonic() - started


DEPLOYMENT = ("prfaas-0", "pd-prefill-0", "pd-decode-0", "kv-index", "router")


def start_deployment(root: Path | None, checkout: Path, model_dir: Path, procs: ProcessGroup, work: Path,
                     kv_profile: str = "wan", prfaas_preexec=None, prfaas_host: str | None = None,
                     prfaas_env: dict[str, str] | None = None, link: tuple[float, float] = (1.0, 20.0),
                     startup_timeout_s: float = STARTUP_TIMEOUT_S,
                     pd_env: dict[str, str] | None = None, engine: str = "sglang",
                     host: str = "127.0.0.1", profile: ServerProfile = GPU_PROFILE,
                     profile_env: dict[str, str] | None = None, switchable: bool = False) -> RunningDeployment:
    """Start :data:`DEPLOYMENT` (names in ``procs``) and pin the router's threshold; raises
    :class:`~prfaas_sglang.demo.cluster.StartupError` (quoting the server's log) when any does not
    become healthy within ``startup_timeout_s``. ``prfaas_env`` / ``pd_env``: added to the
    PrfaaS server's / the PD servers' environment; ``kv_profile`` and ``profile_env``: the PrfaaS
    server's KV profile and the variables that go with it (what :meth:`RunningDeployment.restart_prfaas`
    switches). ``switchable``: :func:`e2e_topology`'s second, switchable PD prefill."""
    import yaml

    topology = e2e_topology(model_dir, PortPicker(), host=host, prfaas_host=prfaas_host, link=link,
                            emulation=MOCK_EMULATION if engine == "mock" else None, profile=profile,
                            switchable=switchable)
    config = work / f"topology{'-shaped' if prfaas_preexec else ''}.yaml"
    config.write_text(yaml.safe_dump(topology, sort_keys=False))
    env = bundle_env(root, checkout, profile=profile)
    launch = [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config)]
    mock = ["--engine", engine] if engine == "mock" else []
    dep = RunningDeployment(topology, config, env, procs, work, [*launch, "--node", "prfaas-0", *mock],
                            {**env, **(prfaas_env or {}), "PRFAAS_HOOK_REPORT": str(hook_report(work, "prfaas-0"))},
                            prfaas_preexec, startup_timeout_s)
    dep.start_prfaas(kv_profile, profile_env)
    pd_names = (*pd_prefill_names(switchable), "pd-decode-0")
    for name in pd_names:
        procs.start(name, [*launch, "--node", name, *mock], {**(pd_env or {}), "PRFAAS_HOOK_REPORT": str(hook_report(work, name))},
                    base_env=env)
    for name in ("prfaas-0", *pd_names):  # the error quotes the server's last words
        procs.wait_healthy(dep.url(name) + "/health", procs.latest(name), timeout_s=startup_timeout_s)
    procs.start("kv-index", [*launch, "--node", "kv-index"], base_env=env)
    procs.wait_healthy(dep.url("kv-index") + "/health", procs.latest("kv-index"), timeout_s=120)
    start_router(procs, "router", config, env, list(profile.router_args), dep.url("router"), profile.threshold_tokens)
    return dep


def start_router(procs: ProcessGroup, name: str, config: Path, env: dict[str, str], router_args: list[str], url: str,
                 threshold_tokens: int, wait: bool = True) -> None:
    """Start the router node of ``config`` as ``name`` in ``procs`` (``router_args`` after the
    launcher's ``--``), then, unless ``wait`` is False, :func:`router_ready`. To start several side by side
    (each start is mostly imports), start each with ``wait=False``, then wait for each."""
    launch = [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config), "--node", "router"]
    procs.start(name, [*launch, *(("--", *router_args) if router_args else ())], {"PRFAAS_ADMIN_TOKEN": ADMIN_TOKEN},
                base_env=env)
    if wait:
        router_ready(procs, name, url, threshold_tokens)


def router_ready(procs: ProcessGroup, name: str, url: str, threshold_tokens: int) -> None:
    """Wait until router ``name`` of ``procs`` answers healthy at ``url``, and pin its threshold through
    the admin API (RuntimeError if that is refused)."""
    procs.wait_healthy(url + "/health", procs.latest(name), timeout_s=120)
    status, _, body = http("POST", url + "/admin/threshold", {"threshold_tokens": threshold_tokens},
                           headers=ADMIN_HEADERS)
    if status != 200:
        raise RuntimeError(f"{name}: pinning the threshold failed: {status} {body[:200]!r}")


def route_header(headers: dict) -> str | None:
    """The router's ``X-Prfaas-Route`` header (``{cluster kind}/{prefill}/{decode}``), in either spelling."""
    return headers.get("x-prfaas-route") or headers.get("X-Prfaas-Route")


def start_reference(root: Path, checkout: Path, model_dir: Path, procs: ProcessGroup, wait: bool = True,
                    profile: ServerProfile = GPU_PROFILE) -> str:
    """Start the plain server (``reference`` in ``procs``); its URL, healthy unless ``wait`` is False
    (then :func:`wait_reference` before asking it)."""
    port = free_port()
    procs.start("reference", [sys.executable, "-m", "prfaas_sglang.launch", "--role", "single", "--model-path",
                              str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--", *profile.flags],
                {"PRFAAS_HOOK_REPORT": str(hook_report(procs.log_dir.parent, "reference"))},
                base_env=bundle_env(root, checkout, profile=profile))
    url = f"http://127.0.0.1:{port}"
    if wait:
        wait_reference(procs, url)
    return url


def wait_reference(procs: ProcessGroup, url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until the plain server at ``url`` (``reference`` in ``procs``) is healthy; :class:`StartupError`
    when it exits first or ``timeout_s`` passes."""
    procs.wait_healthy(url + "/health", procs.latest("reference"), timeout_s=timeout_s)
