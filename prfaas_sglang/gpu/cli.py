"""The ``bench gpu-bundle`` and ``bench gpu-e2e`` commands (argument handling and output)."""

from __future__ import annotations

import argparse
import json
import sys

from prfaas_sglang.gpu import bundle as spec

MODEL_DIR = "model"  # beside site/ in the bundle


def bundle_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prfaas_sglang.gpu.builder import build
    from prfaas_sglang.gpu.model import ModelError, check_with_sglang, make_model

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
        MOCK_CHECKS,
        gpu_unavailable,
        run,
    )

    mock, cpu = args.engine == "mock", args.engine == "sglang-cpu"
    checks = (tuple(dict.fromkeys(CHECK_ALIASES.get(c, c) for c in args.checks.split(","))) if args.checks
              else (MOCK_CHECKS if mock else CPU_CHECKS if cpu else CHECKS))
    if unknown := [c for c in checks if c not in CHECKS]:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if cpu:  # real SGLang on CPU from this environment: no bundle, a tiny Llama unless --model-config
        if wrong := [c for c in checks if c not in CPU_CHECKS]:
            parser.error(f"--engine sglang-cpu runs {', '.join(CPU_CHECKS)} only, not {wrong}")
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
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    result = run(args.bundle, args.model_config, checks, log, engine=args.engine)
    print(json.dumps(result, indent=2) if args.json else json.dumps({k: result[k] for k in ("ok", "passed", "failed")}))
    return 0 if result["ok"] else 1


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
    from prfaas_sglang.gpu.predict import VARIANTS, run

    variants = tuple(v for v in args.variants.split(",") if v)
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
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
