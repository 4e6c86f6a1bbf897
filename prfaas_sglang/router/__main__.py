"""``python -m prfaas_sglang.router``: the PrfaaS global scheduler for the workers of a topology.

    python -m prfaas_sglang.router --config launch/local-two-cluster.yaml [--port 8000] [--threshold 19400]

Where things come from:

* ``t``: the runtime model (:mod:`prfaas_sglang.runtime`) of the topology, i.e. the
  planner's threshold for its instances, cost profiles, link and workload prior,
  unless ``--threshold`` (or ``scheduler.threshold_tokens``) fixes the baseline;
  then the threshold controller moves it (see ``router/threshold.py``).
* page size, KV pool, context length, served model name: each worker's
  ``/server_info`` at start-up (a worker that is not up yet is adopted when it
  comes up; facts that contradict the deployment stop start-up).
* the tokenizer: ``--tokenizer``, else ``model.tokenizer``, else ``model.path``,
  else the workers' ``tokenizer_path``; with none, requests must carry token
  ids (said once at start-up).

Exits 2 with a one-line reason on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.errors import ConfigError, PrfaasError

logger = logging.getLogger("prfaas_sglang.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_router_arguments(p)
    return p


def add_router_arguments(p: argparse.ArgumentParser, with_config: bool = True) -> None:
    """The router's flags; the launcher reuses them for ``--role router``."""
    if with_config:
        p.add_argument("--config", type=Path, required=True, help="topology YAML listing the workers")
    p.add_argument("--host", default=None, help="bind address (default: the topology's router node, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the topology's router node)")
    p.add_argument("--threshold", type=float, help="baseline threshold t, tokens (default: the planner's, from the topology)")
    p.add_argument("--bandwidth-mode", default="scarce",
                   help="scarce | abundant (paper section 3.4.3) | auto: per pair, abundant while the plan's KV at "
                        "Lambda_max fills at most half the link's measured capacity (policy.mode_from_link)")
    p.add_argument("--tokenizer", default=None, help="tokenizer name or directory (default: model.tokenizer of the topology)")
    p.add_argument("--phase-timeout-s", type=float, default=600.0,
                   help="time limit on each leg sent to a worker (prefill, decode) and on a cache "
                        "move, seconds")
    p.add_argument("--cache-transfer", choices=("auto", "off", "always", "never"), default="auto",
                   help="abundant mode: move a prefix cached in the other cluster when the cost model says so "
                        "(auto: where every prefill worker can import one), never (off), or force the move "
                        "either way for benchmarks (always | never)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) clients may ask for (repeatable); default: the workers' served name. "
                        "Requests naming another model get 404")
    p.add_argument("--max-ttft-s", type=float, default=None,
                   help="early rejection: refuse (503 + Retry-After) a request whose best route's estimated TTFT "
                        "exceeds max(this, 2 x its own prefill); default: the topology's scheduler.ttft_slo_s "
                        "(on the engines' clock)")
    p.add_argument("--no-early-rejection", action="store_true", help="admit whatever the estimated TTFT")
    p.add_argument("--placement", choices=("ttft", "threshold", "conditional"), default="ttft",
                   help="ttft: the threshold's cluster unless its expected TTFT (queue + prefill + the link, calibrated) "
                        "exceeds --ttft-target-s and the other cluster's is lower; threshold: the paper's rule alone; "
                        "conditional: a baseline of the kind Dynamo's conditional disaggregation offers, the rule's "
                        "PrfaaS only while its prefill workers hold fewer than --remote-queue-cap requests")
    p.add_argument("--remote-queue-cap", type=int, default=None,
                   help="--placement conditional: requests PrfaaS's prefill workers may hold before long prompts stay on PD")
    p.add_argument("--ttft-target-s", type=float, default=None,
                   help="placement by expected TTFT: the threshold's cluster keeps a request whose expected TTFT is "
                        "within this (engines' seconds); beyond it, the cluster with the lower one wins (default: the "
                        "TTFT SLO, as --max-ttft-s resolves it, so the plan holds while it meets the SLO; 0: always "
                        "the lower)")
    p.add_argument("--no-calibration", action="store_true",
                   help="predict with the topology's cost model as it is (no online calibration from observed TTFTs)")
    p.add_argument("--prefill-scale", action="append", default=[], metavar="CLUSTER=SCALE",
                   help="what the model's prefill takes in CLUSTER (a cluster of the topology, or prfaas | pd for every "
                        "cluster of that kind), times, as measured beforehand: the calibration's starting point "
                        "(repeatable; default 1)")
    p.add_argument("--calibration-max-age-s", type=float, default=30.0,
                   help="a cluster whose calibration saw no first token for this long is predicted by its prior again, "
                        "so one shunned on a few slow answers gets requests again (0: never)")
    p.add_argument("--admission-timeout-s", type=float, default=60.0,
                   help="longest a request waits in the router for decode KV room before 503")
    p.add_argument("--max-waiting", type=int, default=1024, help="requests that may wait for decode room; more get 429")
    p.add_argument("--checkpoint-min-tokens", type=int, default=1024,
                   help="hybrid models: ask the prefill worker for a state checkpoint at the end of a prefix some "
                        "worker holds (custom_params.prfaas_checkpoint_tokens) when it adds at least this many "
                        "tokens of reuse; 0: never")
    p.add_argument("--decode-affinity-slack", type=float, default=0.1,
                   help="prefer the decode worker whose own cache (SGLang's --disaggregation-decode-enable-radix-cache, "
                        "its KV events in the index) holds the prompt's prefix while its free KV is at least "
                        "(1 - this) of the roomiest decode worker's; 0..1, negative: off (always the roomiest)")
    p.add_argument("--kv-memo-mib", type=float, default=64.0,
                   help="memory for the KV index's page-id memo (the block ids of prompts already hashed, so a "
                        "prompt sharing a prefix skips SHA-256 over it; at page size 1 about 2.1 KiB per 256 "
                        "tokens held); 0: keep none")
    p.add_argument("--health-interval-s", type=float, default=2.0,
                   help="how often each worker's /health is polled (a failed leg marks its worker down at once)")
    p.add_argument("--health-timeout-s", type=float, default=5.0,
                   help="how long a /health answer may take (SGLang's runs a one-token generate and answers on a 1 s "
                        "poll); a worker is taken out after --health-misses-to-down checks in a row without one")
    p.add_argument("--health-misses-to-down", type=int, default=2,
                   help="health checks in a row without an answer before a worker is taken out (a refusal or a "
                        "non-200 answer takes it out at once)")
    p.add_argument("--load-interval-s", type=float, default=0.5, help="how often each worker's /v1/loads is polled")
    p.add_argument("--startup-timeout-s", type=float, default=30.0, help="how long to wait for workers' facts at start")
    p.add_argument("--tls-cert-file", default=None, help="serve HTTPS (clients and the admin API) with this certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="the certificate's private key (PEM); with --tls-cert-file")
    lt = p.add_argument_group("long-term scheduler (P/D conversion of nodes with role_switch in the topology)")
    lt.add_argument("--long-term", action="store_true",
                    help="run the long-term controller, one per PD cluster: convert its PD workers between prefill and "
                         "decode when the measured stage throughputs say the split no longer fits (router/longterm.py)")
    lt.add_argument("--long-term-interval-s", type=float, default=60.0, help="seconds between decisions")
    lt.add_argument("--long-term-window-s", type=float, default=300.0, help="what a decision looks at")
    lt.add_argument("--long-term-dwell-s", type=float, default=300.0, help="least time between two conversions")
    lt.add_argument("--long-term-min-requests", type=int, default=100, help="routed requests in the window before deciding")
    lt.add_argument("--long-term-confirm", type=int, default=2, help="decisions in a row wanting the same direction")
    lt.add_argument("--long-term-drain-timeout-s", type=float, default=300.0,
                    help="a conversion whose worker still holds requests after this is abandoned (back in service)")
    p.add_argument("--log-level", default="INFO",
                   help="Python logging level (DEBUG, INFO, WARNING, ...)")


def preflight(workers, topology, config, timeout_s: float, headers: dict | None = None,
              cost_states: dict | None = None) -> dict:
    """Every reachable worker's facts (waiting up to ``timeout_s`` for workers still starting), checked
    (``cost_states``: each pair's cost model's kind of state, which the model of a worker in that pair
    must match: ``workers.facts_problem``).

    Facts that contradict the deployment raise :class:`ConfigError`; a worker still down
    afterwards is left to the health loop. Returns name -> facts; nothing is modified.
    """
    from prfaas_sglang.router.workers import FactsError, facts_problem, parse_server_info
    from prfaas_sglang.wire.server_info import with_live_mode

    deadline = time.monotonic() + timeout_s
    pending, adopted = dict(workers), {}
    while pending:
        for name, worker in list(pending.items()):
            try:
                http_sync.get(worker.url + "/health", timeout_s=config.health_timeout_s).raise_for_status()
                info = http_sync.get_json(worker.url + "/server_info", timeout_s=2.0, headers=headers)
            except http_sync.HttpError:
                continue
            try:  # SGLang 0.5.23 states the role it runs now there (one switched in place since it started)
                info = with_live_mode(info, http_sync.get_json(worker.url + "/model_info", timeout_s=2.0, headers=headers))
            except (http_sync.HttpError, ValueError):
                pass
            try:
                facts = parse_server_info(info)
            except FactsError as err:
                raise ConfigError(f"worker {name}", f"bad /server_info: {err}") from None
            peers = [dataclasses.replace(workers[n], facts=f) for n, f in adopted.items()]
            problem = facts_problem(worker, facts, peers, topology.emulation, cost_states or {})
            if problem:
                raise ConfigError(f"worker {name}", problem)
            adopted[name] = facts
            del pending[name]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for name in pending:
        logger.warning("worker %s is not reachable yet; it is adopted when it answers /server_info", name)
    names = {f.served_model_name for f in adopted.values() if f.served_model_name}
    if len(names) > 1 and not config.served_models:
        raise ConfigError("workers", f"the workers serve different models ({', '.join(sorted(names))}); "
                                     "give --served-model-name or fix the deployment")
    return adopted


def load_tokenizer(args, topology, workers):
    """The tokenizer by the documented order, or None (then requests must carry ids); it renders a chat's
    tools as the workers' SGLang release does (the newest any adopted worker reports)."""
    from prfaas_sglang.tokenizer import PromptTokenizer, tools_as_sent

    as_sent = any(tools_as_sent(w.facts.version) for w in workers.values() if w.facts)
    explicit = args.tokenizer or topology.model.tokenizer
    if explicit:
        return PromptTokenizer.load(explicit, topology.base_dir, as_sent)
    candidates = [topology.model.path] + [w.facts.tokenizer_path for w in workers.values() if w.facts]
    for ref in candidates:
        if ref:
            try:
                return PromptTokenizer.load(ref, topology.base_dir, as_sent)
            except PrfaasError:
                continue
    return None


def make_service(args: argparse.Namespace):
    """The router's service for ``args``, the URL of the topology's kv-index service (or None), and
    the deployment's keys (``PRFAAS_SECRET_FILE``; None: no authentication)."""
    from prfaas_sglang import runtime
    from prfaas_sglang.roles import Role
    from prfaas_sglang.router.policy import BandwidthMode
    from prfaas_sglang.router.service import RouterConfig, new_service
    from prfaas_sglang.router.threshold import ControllerSettings
    from prfaas_sglang.router.workers import is_emulated, workers_from_topology
    from prfaas_sglang.security import load_keys, warn_if_open
    from prfaas_sglang.topology import load_topology
    from prfaas_sglang.wire.blocks import memo_bytes_from_mib

    try:
        mode = BandwidthMode.SCARCE if args.bandwidth_mode == "auto" else BandwidthMode(args.bandwidth_mode)
    except ValueError:
        raise ConfigError("--bandwidth-mode", f"expected scarce, abundant or auto, got {args.bandwidth_mode!r}") from None
    if args.ttft_target_s is not None and not args.ttft_target_s >= 0:
        raise ConfigError("--ttft-target-s", f"must be >= 0, got {args.ttft_target_s}")
    if (args.placement == "conditional") != (args.remote_queue_cap is not None):
        raise ConfigError("--remote-queue-cap", "goes with --placement conditional, and it with this")
    if args.remote_queue_cap is not None and args.remote_queue_cap < 1:
        raise ConfigError("--remote-queue-cap", f"must be >= 1, got {args.remote_queue_cap}")
    for flag, value in (("--max-ttft-s", args.max_ttft_s), ("--threshold", args.threshold)):
        if value is not None and not value > 0:
            raise ConfigError(flag, f"must be > 0, got {value}")
    for flag, value in (("--admission-timeout-s", args.admission_timeout_s), ("--phase-timeout-s", args.phase_timeout_s),
                        ("--max-waiting", args.max_waiting), ("--health-interval-s", args.health_interval_s),
                        ("--health-timeout-s", args.health_timeout_s), ("--health-misses-to-down", args.health_misses_to_down),
                        ("--load-interval-s", args.load_interval_s),
                        ("--long-term-drain-timeout-s", args.long_term_drain_timeout_s)):
        if not value > 0:
            raise ConfigError(flag, f"must be > 0, got {value}")
    if args.checkpoint_min_tokens < 0:
        raise ConfigError("--checkpoint-min-tokens", f"must be >= 0 (0: never), got {args.checkpoint_min_tokens}")
    try:
        kv_memo_bytes = memo_bytes_from_mib(args.kv_memo_mib)
    except ValueError as e:
        raise ConfigError("--kv-memo-mib", str(e)) from None
    if not args.decode_affinity_slack <= 1:  # also refuses NaN
        raise ConfigError("--decode-affinity-slack", f"must be <= 1 (negative: off), got {args.decode_affinity_slack}")
    longterm = longterm_settings(args) if args.long_term else None  # checked before waiting for workers
    calibration = calibration_settings(args)
    keys = load_keys()
    warn_if_open(keys, "router")
    topology = load_topology(args.config)
    # validates the scheduler's inputs (every pair's model) before waiting for workers
    cost_states = {pair: model.state for pair, model in runtime.pair_models(topology).items()}
    workers = workers_from_topology(topology)
    node = next(iter(topology.nodes_of(Role.ROUTER)), None)
    args.host = args.host or (node.host if node and node.host else "127.0.0.1")
    args.port = args.port or (node.port if node else None)
    if args.port is None:
        raise ConfigError("--port", "is required (the topology has no router node with a port)")
    config = RouterConfig(mode=mode, auto_mode=args.bandwidth_mode == "auto", phase_timeout_s=args.phase_timeout_s, max_ttft_s=args.max_ttft_s,
                          admission_timeout_s=args.admission_timeout_s, max_waiting=args.max_waiting,
                          health_interval_s=args.health_interval_s, load_interval_s=args.load_interval_s,
                          health_timeout_s=args.health_timeout_s, health_misses_to_down=args.health_misses_to_down,
                          served_models=frozenset(args.served_model_name or ()), threshold_tokens=args.threshold,
                          cache_transfer=args.cache_transfer, checkpoint_min_tokens=args.checkpoint_min_tokens or None,
                          decode_affinity_slack=args.decode_affinity_slack if args.decode_affinity_slack >= 0 else None,
                          kv_memo_bytes=kv_memo_bytes)
    adopted = preflight(workers, topology, config, args.startup_timeout_s, keys.bearer() if keys else None, cost_states)
    emulated = any(is_emulated(f) for f in adopted.values()) if adopted else None
    models = runtime.pair_models(topology, emulated=emulated)
    model = next(iter(models.values()))  # the scheduler's section and the emulation are every pair's
    slo_s = args.max_ttft_s or model.observed_ttft_slo_s
    max_ttft_s = None if args.no_early_rejection else slo_s
    ttft_target_s = None if args.placement != "ttft" else (slo_s if args.ttft_target_s is None else args.ttft_target_s)
    config = dataclasses.replace(config, controller=ControllerSettings(time_scale=1.0 / model.emulation.speedup),
                                 max_ttft_s=max_ttft_s, ttft_target_s=ttft_target_s, calibration=calibration,
                                 remote_queue_cap=args.remote_queue_cap)
    try:
        service = new_service(config, models, workers, emulation_spec=topology.emulation)
    except ValueError as err:  # a --prefill-scale naming no cluster of the topology
        raise ConfigError("--prefill-scale", str(err)) from None
    if longterm is not None:
        service.start_longterm(longterm)  # one controller per PD cluster
        if not any(w.switch_url for w in workers.values()):
            logger.warning("--long-term: no node of the topology has role_switch; decisions will be logged, not applied")
    for name, facts in adopted.items():
        workers[name].facts, workers[name].healthy = facts, True
    service.tokenizer = load_tokenizer(args, topology, workers)
    if service.tokenizer is None:
        logger.warning("no tokenizer configured (model.tokenizer, model.path or the workers' tokenizer_path): "
                       "routing only requests that carry token ids; text and chat prompts get 400")
    for pair, ps in service.pairs.items():
        logger.info("router: %s: t = %.0f tokens (%s), model %s", pair, ps.controller.threshold_tokens,
                    "operator" if ps.controller.operator_baseline_tokens else "planner", ps.runtime.describe())
    index_node = next(iter(topology.nodes_of(Role.KV_INDEX)), None)
    kv_index_url = (f"http://{index_node.host or '127.0.0.1'}:{index_node.port}"
                    if index_node is not None and index_node.port is not None else None)
    return service, kv_index_url, keys


def calibration_settings(args: argparse.Namespace):
    """``CalibrationSettings`` from ``--no-calibration``, ``--prefill-scale`` and ``--calibration-max-age-s``
    (ConfigError naming a bad one)."""
    from prfaas_sglang.plan.profiles import parse_scale_item
    from prfaas_sglang.router.calibration import CalibrationSettings

    scales = []
    for item in args.prefill_scale:
        try:
            scales.append(parse_scale_item(item)[:2])
        except ValueError:
            raise ConfigError("--prefill-scale", f"expected CLUSTER=SCALE (prfaas=1.2), got {item!r}") from None
    if args.calibration_max_age_s < 0:
        raise ConfigError("--calibration-max-age-s", f"must be >= 0 (0: never forgotten), got {args.calibration_max_age_s:g}")
    try:
        return CalibrationSettings(enabled=not args.no_calibration, prior_scales=tuple(scales),
                                   max_age_s=args.calibration_max_age_s or None)
    except ValueError as err:
        raise ConfigError("--prefill-scale", str(err)) from None


def longterm_settings(args: argparse.Namespace):
    """``LongTermSettings`` from the flags (wall seconds, as the router's model of an emulated deployment)."""
    from prfaas_sglang.router.longterm import LongTermSettings

    try:
        return LongTermSettings(interval_s=args.long_term_interval_s, window_s=args.long_term_window_s,
                                min_dwell_s=args.long_term_dwell_s, min_requests=args.long_term_min_requests,
                                confirm=args.long_term_confirm)
    except ValueError as err:
        raise ConfigError("--long-term-*", str(err)) from None


# glibc's mallopt parameters (malloc.h) and what the router sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_HEAP_BYTES = 64 << 20
_HEAP_ALLOC_BELOW_BYTES = 8 << 20


def keep_request_buffers_mapped() -> bool:
    """Let glibc serve the router's per-request buffers (a 32K-token body is 200 KB, and each
    vectorised pass over it allocates as much) from a heap it keeps, instead of mapping fresh
    pages for each one and returning them after: the page faults doubled the time to check a
    body's ids (0.9 -> 0.35 ms per request in ``bench router-overhead``). Best effort: glibc only;
    an operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` win. Returns whether it applied."""
    import ctypes
    import ctypes.util
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_ALLOC_BELOW_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_HEAP_BYTES))


def tls_context(cert_file: str | None, key_file: str | None):
    """A server TLS context (TLS 1.2 and up) for the router's port, or None without a certificate."""
    if bool(cert_file) != bool(key_file):
        raise ConfigError("--tls-cert-file", "and --tls-key-file go together")
    if not cert_file:
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError("--tls-cert-file", f"cannot load {cert_file} / {key_file}: {err}") from None
    return context


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ssl_context = tls_context(args.tls_cert_file, args.tls_key_file)  # before waiting for workers
        service, kv_index_url, keys = make_service(args)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    import asyncio

    from aiohttp import web

    from prfaas_sglang.procgc import freeze_startup_objects
    from prfaas_sglang.router.app import build_app

    try:  # uvloop when installed (it is with the engine and mock environments): a faster event loop
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    if not keep_request_buffers_mapped():
        logging.getLogger("prfaas.router").info("malloc left at its defaults (not glibc, or MALLOC_* set)")
    # handler_cancellation: a client that disconnects cancels its request, and with it both PD legs.
    from prfaas_sglang.router.loops import LongTermOptions

    options = LongTermOptions(drain_timeout_s=args.long_term_drain_timeout_s)
    app = build_app(service, kv_index_url, keys, options)
    freeze_startup_objects()  # the tokenizer's ~370K objects: out of every full collection
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None,
                handler_cancellation=True, ssl_context=ssl_context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
