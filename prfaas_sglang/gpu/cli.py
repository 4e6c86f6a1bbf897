"""The ``bench gpu-bundle``, ``bench gpu-e2e``, ``bench profile`` and ``bench predict`` commands (their flags,
argument handling and output; registered in :data:`SUBCOMMANDS`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prfaas_sglang.bench.subcommands import Subcommand
from prfaas_sglang.gpu import bundle as spec

MODEL_DIR = "model"  # beside site/ in the bundle


def bundle_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prfaas_sglang.gpu.builder import build
    from prfaas_sglang.gpu.tiny_model import ModelError, check_with_sglang, make_model

    budget = int(args.budget_mib * 2**20) if args.budget_mib is not None else spec.BUNDLE_BUDGET_BYTES
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        recipe = make_model(args.out / MODEL_DIR, config=args.model_config, log=log)
        recipe.update(check_with_sglang(args.out / MODEL_DIR))
        manifest = build(args.out, args.python_version or spec.PYTHON_VERSION, args.wheelhouse, budget, log=log,
                         extra_dirs=(MODEL_DIR,))
    except (spec.BundleError, ModelError) as err:
        print(f"gpu-bundle: {err}", file=sys.stderr)
        return 1
    manifest["model"] = recipe
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(f"bundle: {args.out / 'bundle.tar.xz'} ({manifest['packed_bytes'] / 2**20:.1f} MiB of "
              f"{manifest['budget_bytes'] / 2**20:.0f}), {len(manifest['dists'])} distributions, "
              f"{manifest['verified_files']} traced files verified")
    return 0


def e2e_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prfaas_sglang.gpu.e2e import (
        CHECK_ALIASES,
        CHECKS,
        CPU_CHECKS,
        CPU_WITHOUT,
        MOCK_CHECKS,
        default_checks,
        gpu_unavailable,
    )

    mock, cpu = args.engine == "mock", args.engine == "sglang-cpu"
    checks = (tuple(dict.fromkeys(CHECK_ALIASES.get(c, c) for c in args.checks.split(","))) if args.checks
              else default_checks(args.engine))
    if unknown := [c for c in checks if c not in CHECKS]:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if cpu:  # real SGLang on CPU from this environment: no bundle, a tiny Llama unless --model-config
        if wrong := [c for c in checks if c not in CPU_CHECKS]:
            why = "".join(f"; {c}: {CPU_WITHOUT[c]}" for c in wrong if c in CPU_WITHOUT)
            parser.error(f"--engine sglang-cpu runs {', '.join(CPU_CHECKS)} only, not {wrong}{why}")
    elif mock:  # the harness's dry run on CPU: emulated engines, no bundle
        if wrong := [c for c in checks if c not in MOCK_CHECKS]:
            parser.error(f"--engine mock runs {', '.join(MOCK_CHECKS)} only, not {wrong}")
        if args.model_config is None or not (args.model_config / "tokenizer.json").is_file():
            parser.error("--engine mock needs --model-config DIR, a model directory with its tokenizer "
                         "(bench gpu-bundle writes one to OUT/model)")
    else:
        if (why := gpu_unavailable()) is not None:
            print(f"gpu-e2e: {why}", file=sys.stderr)
            return 2
        if args.bundle is None or not args.bundle.is_dir():
            parser.error(f"--bundle {args.bundle}: not a directory (build it with: bench gpu-bundle --out DIR)")
    if args.predict is not None:
        if mock:
            parser.error("--predict runs on real SGLang only (--engine sglang or sglang-cpu)")
        if not args.predict.is_file():
            parser.error(f"--predict {args.predict}: no such file (write one with: bench profile --out FILE)")
        if args.predict_requests < 1:
            parser.error("--predict-requests must be >= 1")
    # the checks import the harness (gpu/e2e.py), not the other way round
    from prfaas_sglang.gpu.checks import run

    log = _log(args)
    then = None if args.predict is None else ("predict", _predict_step(args, log))
    result = run(args.bundle, args.model_config, checks, log, engine=args.engine, then=then)
    shown = ("ok", "passed", "failed") + (("predict",) if then else ())
    print(json.dumps(result, indent=2) if args.json else json.dumps({k: result[k] for k in shown if k in result}))
    return 0 if result["ok"] else 1


def _predict_step(args: argparse.Namespace, log):
    """``bench predict``'s run as a step on gpu-e2e's deployment (``--predict``): every variant, rows kept."""
    from prfaas_sglang.gpu.predict import run as predict

    return lambda ctx: predict(args.engine, None, args.predict, log, requests=args.predict_requests,
                               dep=ctx.dep, model_dir=ctx.model_dir)


def _gpu_unready(command: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
    """For ``--engine sglang``: 2 (after one line) without a GPU; a usage error without the bundle.
    None when the command can go on."""
    from prfaas_sglang.gpu.e2e import gpu_unavailable

    if args.engine != "sglang":
        return None
    if (why := gpu_unavailable()) is not None:
        print(f"{command}: {why}", file=sys.stderr)
        return 2
    if args.bundle is None or not args.bundle.is_dir():
        parser.error(f"--bundle {args.bundle}: not a directory (build it with: bench gpu-bundle --out DIR)")
    return None


def _log(args: argparse.Namespace):
    return (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))


def profile_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prfaas_sglang.errors import ConfigError
    from prfaas_sglang.gpu.profile import run

    if args.roofline_gpus < 1:
        parser.error("--roofline-gpus must be >= 1")
    if (code := _gpu_unready("profile", args, parser)) is not None:
        return code
    try:
        result = run(args.engine, args.bundle, args.model_config, args.out, _log(args),
                     roofline_accelerator=args.roofline_accelerator, roofline_gpus=args.roofline_gpus)
    except (ConfigError, RuntimeError, ValueError, OSError) as err:
        print(f"profile: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else f"profile: {result['profile']} ({result['seconds']} s)")
    return 0


def predict_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prfaas_sglang.errors import ConfigError
    from prfaas_sglang.gpu.predict import ALL_VARIANTS, run

    variants = tuple(v for v in args.variants.split(",") if v)
    if unknown := [v for v in variants if v not in ALL_VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(ALL_VARIANTS)}")
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if not args.measured.is_file():
        parser.error(f"--measured {args.measured}: no such file (write one with: bench profile --out FILE)")
    if (code := _gpu_unready("predict", args, parser)) is not None:
        return code
    try:
        result = run(args.engine, args.bundle, args.measured, _log(args), requests=args.requests, variants=variants,
                     roofline_accelerator=args.roofline_accelerator, roofline_gpus=args.roofline_gpus)
    except (ConfigError, RuntimeError, ValueError, OSError) as err:
        print(f"predict: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else
          json.dumps({k: {m: v[m] for m in v if m != "rows"} for k, v in result["variants"].items()}, indent=2))
    return 0


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output directory (keep it git-ignored, e.g. out/gpu-bundle)")
    parser.add_argument("--python-version", default=None, help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--wheelhouse", type=Path, default=None, help="take wheels from this directory before the index")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="packed-size budget (default: 64 MiB carry less 8 for the checkout)")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="a hybrid config.json (or its directory) instead of the tiny model's")
    parser.add_argument("--json", action="store_true",
                        help="print the bundle's manifest as JSON (progress to stderr)")


def add_e2e_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (bundle.tar.xz inside)")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="a hybrid model directory instead of the bundle's tiny model")
    parser.add_argument("--checks", default=None, help="comma list (default: all); wan-profile is another name for shaped-link")
    parser.add_argument("--engine", choices=("sglang", "sglang-cpu", "mock"), default="sglang",
                        help="sglang-cpu: real SGLang on this machine's CPU (a tiny Llama unless --model-config; every check but "
                             "state-events, which needs a hybrid and, on CPU, AMX; root for shaped-link); mock: the harness's own dry run with "
                             "emulated engines (shaped-link, routing, kv-index, failover; needs --model-config, root); it checks "
                             "the harness, not SGLang")
    parser.add_argument("--predict", type=Path, default=None, metavar="MEASURED",
                        help="also run bench predict (every variant) on the same deployment, after the checks and "
                             "before failover, against this measured profile")
    parser.add_argument("--predict-requests", type=int, default=50, help="with --predict: requests per router")
    parser.add_argument("--json", action="store_true",
                        help="print the whole result as JSON (progress to stderr); "
                             "default: only ok, passed and failed")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("sglang", "sglang-cpu"), default="sglang",
                        help="sglang: the GPU machine, from --bundle (the tiny hybrid); sglang-cpu: this CPU, a tiny Llama "
                             "(proves the pipeline, not the numbers)")
    parser.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (--engine sglang)")
    parser.add_argument("--model-config", type=Path, default=None, help="a model directory instead of the tiny model")
    parser.add_argument("--out", type=Path, required=True, help="the profile file to write (YAML)")
    parser.add_argument("--roofline-accelerator", default="h200x8",
                        help="the accelerator file the roofline uses (its per-GPU specs)")
    parser.add_argument("--roofline-gpus", type=int, default=1, help="GPUs of it the roofline counts (the server's)")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON (progress to stderr)")


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("sglang", "sglang-cpu"), default="sglang",
                        help="sglang: the GPU machine, from --bundle (the tiny hybrid); "
                             "sglang-cpu: real SGLang on this CPU, a tiny Llama")
    parser.add_argument("--bundle", type=Path, default=None, help="the gpu-bundle output directory (--engine sglang)")
    parser.add_argument("--measured", type=Path, required=True, help="the profile bench profile wrote for this engine")
    parser.add_argument("--requests", type=int, default=50, help="per router, one at a time")
    parser.add_argument("--variants", default="roofline,measured,off-2x",
                        help="comma list of cost profiles to compare, each behind its own router: "
                             "roofline, measured, off-2x (the measured one, times doubled), off-2x-given "
                             "(the same without calibration), off-half and off-half-given (times halved)")
    parser.add_argument("--roofline-accelerator", default="h200x8",
                        help="the accelerator file the roofline variant uses (its per-GPU specs)")
    parser.add_argument("--roofline-gpus", type=int, default=1,
                        help="GPUs of it the roofline variant counts (the server's)")
    parser.add_argument("--json", action="store_true",
                        help="print the whole result as JSON, per-request rows included "
                             "(progress to stderr)")


SUBCOMMANDS = {
    "gpu-bundle": Subcommand(add_bundle_arguments, lambda args, inv: bundle_main(args, inv.parser)),
    "gpu-e2e": Subcommand(add_e2e_arguments, lambda args, inv: e2e_main(args, inv.parser)),
    "profile": Subcommand(add_profile_arguments, lambda args, inv: profile_main(args, inv.parser)),
    "predict": Subcommand(add_predict_arguments, lambda args, inv: predict_main(args, inv.parser)),
}
