"""Subprocess body for test_plugin.py: runs scenarios against real SGLang, prints JSON.

Usage: python plugin_probe.py <scenario>[,<scenario>...] <model_dir>

SGLang is imported once; each scenario then runs in a child forked from that process, so that
what one patches, registers or exits with (SGLang's HookRegistry and the functions it patches are
process-global) reaches no other, without paying SGLang's import once per scenario.
"""

from __future__ import annotations

import json
import os
import sys


def server_args(model_dir: str, mode: str, backend: str = "mooncake_tcp"):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_dir,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        device="cuda",  # resolution only; nothing is allocated (see notes: hybrid args need it on CPU)
        skip_tokenizer_init=True,
        load_format="dummy",
        mamba_radix_cache_strategy="no_buffer",
        disable_overlap_schedule=True,
    )


def attempt(model_dir: str, env: dict, mode: str, backend: str = "mooncake_tcp") -> dict:
    for key in ("PRFAAS_ROLE", "PRFAAS_KV_TRANSPORT", "MC_FORCE_TCP"):
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        args = server_args(model_dir, mode, backend)
        if hasattr(args, "resolve_once"):  # SGLang 0.5.23 resolves on demand (0.5.15: in __post_init__)
            args.resolve_once()
        from prfaas_sglang._compat.accessors import resolving

        view = resolving(args)
        return {"ok": True, "mode": view.disaggregation_mode, "backend": view.disaggregation_transfer_backend}
    except BaseException as err:  # noqa: BLE001 - report whatever stops startup
        return {"ok": False, "type": type(err).__name__, "message": str(err)}


def scenario_role_contract(model_dir: str) -> dict:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # real entry-point discovery: must find prfaas_sglang.plugin:register
    from prfaas_sglang.plugin import HOOKS, reaches_hook, resolve_target

    installed = {spec.name: reaches_hook(resolve_target(spec.target), spec.load_hook()) for spec in HOOKS if spec.applies()}
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    registered = {"prfaas-hybrid": getattr(get_radix_cache_factory("prfaas-hybrid"), "__qualname__", None),
                  "prfaas-zmq": getattr(EventPublisherFactory._registry.get("prfaas-zmq"), "__qualname__", None)}
    return {
        "installed": installed,
        "registered": registered,
        "no_role_decode": attempt(model_dir, {}, "decode"),
        "prfaas_prefill": attempt(model_dir, {"PRFAAS_ROLE": "prfaas"}, "prefill"),
        "prfaas_decode": attempt(model_dir, {"PRFAAS_ROLE": "prfaas"}, "decode"),
        "pd_decode_decode": attempt(model_dir, {"PRFAAS_ROLE": "pd-decode"}, "decode"),
        "pd_decode_prefill": attempt(model_dir, {"PRFAAS_ROLE": "pd-decode"}, "prefill"),
        "prfaas_tcp_without_force": attempt(
            model_dir, {"PRFAAS_ROLE": "prfaas", "PRFAAS_KV_TRANSPORT": "tcp", "MC_FORCE_TCP": "0"}, "prefill", "mooncake"
        ),
        "unknown_role": attempt(model_dir, {"PRFAAS_ROLE": "decoder"}, "decode"),
    }


def scenario_unresolvable_target(model_dir: str) -> dict:
    import dataclasses

    from prfaas_sglang import plugin

    bad = dataclasses.replace(plugin.HOOKS[0], name="bad", target="sglang.srt.arg_groups.pd_disaggregation_hook.no_such_function")
    plugin.HOOKS = (*plugin.HOOKS, bad)
    try:
        plugin.register()
    except SystemExit as err:
        return {"exited": True, "is_system_exit": isinstance(err, SystemExit), "message": str(err.code)}
    return {"exited": False}


def scenario_apply_fails(model_dir: str) -> dict:
    """Target resolves, but SGLang's HookRegistry refuses it (AROUND on a class) and only logs."""
    import dataclasses

    from prfaas_sglang import plugin

    bad = dataclasses.replace(plugin.HOOKS[0], name="class-around", target="sglang.srt.server_args.ServerArgs", hook_type="around")
    plugin.HOOKS = (*plugin.HOOKS, bad)
    try:
        plugin.register()
    except SystemExit as err:
        return {"exited": True, "message": str(err.code)}
    return {"exited": False}


def scenario_load_plugins_stops(model_dir: str) -> dict:
    """The same failure reached through sglang's own load_plugins(): it must not be swallowed."""
    import dataclasses

    from prfaas_sglang import plugin

    bad = dataclasses.replace(plugin.HOOKS[0], name="bad", target="sglang.srt.no_such_module.fn")
    plugin.HOOKS = (*plugin.HOOKS, bad)
    from sglang.srt.plugins import load_plugins

    try:
        load_plugins()
    except SystemExit as err:
        return {"exited": True, "message": str(err.code)}
    return {"exited": False}


def scenario_idempotent(model_dir: str) -> dict:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from prfaas_sglang import plugin

    plugin.register()
    plugin.register()
    specs = [spec for spec in plugin.HOOKS if spec.applies()]  # a retired hook registers nothing
    targets = {spec.target for spec in specs}
    # One registration per hook, however often register() runs (two hooks may share a target).
    return {"extra_registrations": {t: len(HookRegistry._hooks[t]) - sum(s.target == t for s in specs)
                                    for t in targets if len(HookRegistry._hooks[t]) != sum(s.target == t for s in specs)},
            "targets": len(targets)}


def in_child(name: str, model_dir: str) -> dict:
    """``scenario_<name>`` in a forked child; its result (or what it raised) comes back over a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, write, leave without the parent's exit handlers
        os.close(read_end)
        try:
            out = globals()[f"scenario_{name}"](model_dir)
        except BaseException as err:  # noqa: BLE001 - reported to the parent, whatever it is
            out = {"probe_error": f"{type(err).__name__}: {err}"}
        with os.fdopen(write_end, "w") as pipe:
            json.dump(out, pipe)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else {"probe_error": f"scenario {name}: the child wrote nothing"}


if __name__ == "__main__":
    names, model = sys.argv[1].split(","), sys.argv[2]
    import sglang.srt.plugins  # noqa: F401 - SGLang's import, once, before the forks
    import sglang.srt.server_args  # noqa: F401

    print("PROBE-RESULT " + json.dumps({name: in_child(name, model) for name in names}))
