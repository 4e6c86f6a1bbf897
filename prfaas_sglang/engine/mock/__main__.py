"""``python -m prfaas_sglang.engine.mock``: one emulated SGLang worker (normally started by the launcher).

Exits 2 with a one-line reason on a bad flag or profile; stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from prfaas_sglang._pin import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from prfaas_sglang.errors import ConfigError, PrfaasError
from prfaas_sglang.roles import ROLE_SPECS, Role, parse_role


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prfaas_sglang.engine.mock", description=__doc__)
    p.add_argument("--role", required=True, help="prfaas | pd-prefill | pd-decode")
    p.add_argument("--host", default="127.0.0.1", help="interface the HTTP server binds to")
    p.add_argument("--port", type=int, required=True, help="the HTTP (SGLang API) port")
    p.add_argument("--bootstrap-port", type=int, help="prefill roles: the bootstrap server's port")
    p.add_argument("--kv-events-port", type=int, help="publish SGLang KV events on tcp://HOST:PORT")
    p.add_argument("--telemetry-port", type=int, help="prefill roles: publish link telemetry on tcp://HOST:PORT")
    p.add_argument("--profile", required=True, help="MODEL@ACCELERATOR (planner data) or a measured profile YAML")
    p.add_argument("--served-model-name", default=None,
                   help="model name the API reports (default: the MODEL part of --profile)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide every emulated duration by this")
    p.add_argument("--kv-scale", type=float, default=0.01, help="ship S_kv(l) * kv_scale real bytes per request")
    p.add_argument("--max-batch", type=int, default=None, help="decode batch limit (default: the profile's)")
    p.add_argument("--page-size", type=int, default=512, help="prefix-cache block size, tokens")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="decode: stream every Nth token, as SGLang's flag (tokens 1, N+1, 2N+1, ..., and the last)")
    p.add_argument("--cache-tokens", type=int, default=2_097_152, help="prefix-cache capacity, tokens")
    p.add_argument("--context-tokens", type=int, default=131_072, help="longest prompt + output accepted")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="decode: KV pool, tokens (default: what the profile's HBM holds next to the weights)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="prefill: new tokens per forward, shared FCFS by waiting requests (SGLang's flag; -1: no chunking)")
    p.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true",
                   help="decode role: keep finished sequences in a prefix cache; the prefill ships only the KV beyond "
                        "the prefix found there (SGLang's flag of the same name)")
    p.add_argument("--enable-pd-role-switch", action="store_true",
                   help="PD roles: serve POST /pd_role_switch (turn prefill into decode or back when idle; "
                        "SGLang 0.5.23's flag of the same name)")
    p.add_argument("--kv-buffer-mb", type=int, default=1024, help="decode: landing buffer for KV in flight, MiB")
    p.add_argument("--sglang-release", default=PINNED_SGLANG_VERSION,
                   help=f"the SGLang release this worker reports as its version (one of "
                        f"{', '.join(SUPPORTED_SGLANG_VERSIONS)}; default: the pin, %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenize text/chat and detokenize outputs with this tokenizer (a shipped name such as "
                        "prfaas-tiny-chatml, or a directory); default: ids, or one pseudo-token per word")
    p.add_argument("--bootstrap-timeout-s", type=float, default=300.0,
                   help="how long a prefill waits for its decode partner and a decode for room or KV (SGLang: 300)")
    from prfaas_sglang.engine.mock.truth import TRUTH_MODELS

    truth = p.add_argument_group("service-time truth (engine/mock/truth.py: apart from the topology's cost model; "
                                 "never reported to a router)")
    truth.add_argument("--prefill-bias", type=float, default=1.0,
                       help="prefill takes this times what the profile predicts (mean over requests)")
    truth.add_argument("--decode-bias", type=float, default=1.0,
                       help="a decode step takes this times what the profile predicts (mean over steps)")
    truth.add_argument("--noise-sigma", type=float, default=0.0,
                       help="log-normal noise (mean one) per request's prefill and per decode step, this sigma")
    truth.add_argument("--noise-seed", type=int, default=0, help="the noise's random seed")
    truth.add_argument("--truth-model", choices=TRUTH_MODELS, default="profile",
                       help="profile: the profile's own form (chunks sum to T(l)); batched: per-forward and per-request "
                            "costs, a decode step rising with the batch, slow periods (engine/mock/truth.py)")
    return p


def truth_from_args(args: argparse.Namespace):
    """The engine's :class:`~prfaas_sglang.engine.mock.truth.ServiceTruth` (raises ConfigError naming a bad flag)."""
    from prfaas_sglang.engine.mock.truth import ServiceTruth

    return ServiceTruth(args.prefill_bias, args.decode_bias, args.noise_sigma, args.noise_seed, args.truth_model)


def config_from_args(args: argparse.Namespace):
    """The worker's config; the deployment secret and peers come from ``PRFAAS_SECRET_FILE`` and
    ``PRFAAS_PEER_HOSTS`` (raises ConfigError for a bad one)."""
    from prfaas_sglang.engine.mock.engine import MockConfig
    from prfaas_sglang.security import load_keys, peer_hosts

    role = parse_role(args.role)
    spec = ROLE_SPECS[role]
    if not spec.is_engine_role:
        raise ConfigError("--role", f"{role.value} is not an engine role")
    if spec.disaggregation_mode == "prefill" and args.bootstrap_port is None:
        raise ConfigError("--bootstrap-port", f"is required for role {role.value}")
    for flag, value in (("--page-size", args.page_size), ("--cache-tokens", args.cache_tokens),
                        ("--context-tokens", args.context_tokens), ("--kv-buffer-mb", args.kv_buffer_mb),
                        ("--max-total-tokens", args.max_total_tokens or 1), ("--stream-interval", args.stream_interval)):
        if value < 1:
            raise ConfigError(flag, f"must be >= 1, got {value}")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        raise ConfigError("--chunked-prefill-size", f"must be >= 1 or -1 (no chunking), got {args.chunked_prefill_size}")
    if not args.bootstrap_timeout_s > 0:
        raise ConfigError("--bootstrap-timeout-s", "must be > 0")
    if args.enable_pd_role_switch and role not in (Role.PD_PREFILL, Role.PD_DECODE):
        raise ConfigError("--enable-pd-role-switch", f"is for PD-cluster roles, not {role.value}")
    if args.enable_pd_role_switch and args.bootstrap_port is None:
        raise ConfigError("--bootstrap-port", "is required with --enable-pd-role-switch (served whenever the worker is prefill)")
    if args.enable_pd_role_switch and args.disaggregation_decode_enable_radix_cache:
        raise ConfigError("--enable-pd-role-switch", "and --disaggregation-decode-enable-radix-cache do not combine yet")
    if args.disaggregation_decode_enable_radix_cache and spec.disaggregation_mode != "decode":
        raise ConfigError("--disaggregation-decode-enable-radix-cache", f"is for decode roles, not {role.value}")
    _check_release(args.sglang_release)
    prefill_cache, min_shared, chunk_checkpoints = _cache_policy_from_env(args.cache_tokens)
    if spec.disaggregation_mode == "prefill":  # its KV sender reads the link at start: refuse a bad one here, by name
        from prfaas_sglang.envs import envs
        from prfaas_sglang.transport.lane_pacing import LanePacing

        envs.KV_LANE_PACING.parse(LanePacing.parse)
    return MockConfig(
        role=role, host=args.host, port=args.port, profile=args.profile,
        served_model_name=args.served_model_name or args.profile.split("@", 1)[0],
        bootstrap_port=args.bootstrap_port, kv_events_port=args.kv_events_port, telemetry_port=args.telemetry_port,
        speedup=args.speedup,
        kv_scale=args.kv_scale, max_batch=args.max_batch, page_size=args.page_size, cache_tokens=args.cache_tokens,
        stream_interval=args.stream_interval, context_tokens=args.context_tokens, kv_buffer_bytes=args.kv_buffer_mb << 20, bootstrap_timeout_s=args.bootstrap_timeout_s,
        max_total_tokens=args.max_total_tokens, tokenizer=args.tokenizer,
        decode_radix_cache=args.disaggregation_decode_enable_radix_cache,
        enable_pd_role_switch=args.enable_pd_role_switch,
        chunked_prefill_size=None if args.chunked_prefill_size == -1 else args.chunked_prefill_size,
        keys=load_keys(), peer_hosts=peer_hosts(),
        prefill_cache=prefill_cache, prefill_cache_min_shared_tokens=min_shared, chunk_checkpoints=chunk_checkpoints,
        sglang_release=args.sglang_release,
    )


def _check_release(release: str) -> None:
    """Raise ConfigError naming ``--sglang-release`` unless ``release`` is one the upstream adapter accepts
    (a supported release, or ``PRFAAS_ALLOW_SGLANG_VERSION``'s)."""
    from prfaas_sglang._compat import require_supported
    from prfaas_sglang.errors import UpstreamVersionError

    try:
        require_supported(release, "--sglang-release")
    except UpstreamVersionError as err:
        raise ConfigError("--sglang-release", str(err)) from None


def _cache_policy_from_env(cache_tokens: int) -> tuple[str, int, bool]:
    """What a prefix cache of ``cache_tokens`` keeps, read as the SGLang cache backend reads it
    (``kvindex/admission_env.py``): (mode, min shared tokens, a checkpoint per chunk); unset mode
    is SGLang's ``all``. Raises ConfigError naming the variable."""
    from prfaas_sglang.envs import envs
    from prfaas_sglang.kvindex.admission import PrefixAdmission
    from prfaas_sglang.kvindex.admission_env import admission_from_env, chunk_checkpoints_from_env

    try:
        admission = admission_from_env(cache_tokens) or PrefixAdmission("all")
    except ValueError as err:
        raise ConfigError(envs.PREFILL_CACHE.name, str(err)) from None
    try:
        chunk_checkpoints = chunk_checkpoints_from_env()
    except ValueError as err:
        raise ConfigError(envs.STATE_CHECKPOINTS.name, str(err)) from None
    return admission.mode, admission.min_shared_tokens, chunk_checkpoints


async def _run(config, timing, tokenizer, truth) -> None:
    from prfaas_sglang.engine.mock.engine import MockEngine
    from prfaas_sglang.engine.mock.sglang_http import serve
    from prfaas_sglang.procgc import freeze_startup_objects

    engine = MockEngine(config, timing, tokenizer, truth)
    freeze_startup_objects()  # a loaded tokenizer's objects: out of every full collection (emulated timings)
    task = asyncio.create_task(serve(config, engine))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def check_decode_radix_cache(config, timing) -> None:
    """SGLang 0.5.15 refuses a decode-side radix cache for sliding-window models
    (``mem_cache/kv_cache_builder.py``), and so does the emulator; linear-attention hybrids have it
    through patch 0001 and ``hooks/decode_radix`` (full-attention KV reused, the state always shipped)."""
    if config.decode_radix_cache and timing.model is not None and timing.model.sliding_window is not None:
        raise ConfigError("--disaggregation-decode-enable-radix-cache",
                          f"is incompatible with sliding-window models such as {config.profile} in SGLang 0.5.15")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from prfaas_sglang.engine.mock.timing import load_timing

        config = config_from_args(args)
        truth = truth_from_args(args)
        timing = load_timing(args.profile, args.speedup, args.kv_scale, args.max_batch)
        check_decode_radix_cache(config, timing)
        from prfaas_sglang.security import warn_if_open

        warn_if_open(config.keys, f"emulated {config.role.value} worker")
        tokenizer = None
        if args.tokenizer:
            from prfaas_sglang.tokenizer import PromptTokenizer

            tokenizer = PromptTokenizer.load(args.tokenizer)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if not truth.exact:
        print(f"emulated {config.role.value} worker: service-time truth {truth}", file=sys.stderr)
    asyncio.run(_run(config, timing, tokenizer, truth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
