"""The checks of ``bench gpu-e2e`` and the run that does them (:func:`run`; they need the GPU
machine; see ``gpu/e2e.py`` for what each shows). This module imports ``gpu/e2e.py``, never the
other way round."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prfaas_sglang.demo.cluster import ProcessGroup, free_port
from prfaas_sglang.gpu.e2e import (
    ADMIN_HEADERS,
    ADMIN_TOKEN,
    GPU_PROFILE,
    NEED_REFERENCE,
    SHAPED_DELAY_RTT_MS,
    SHAPED_RATE_MBIT,
    SHAPED_REQUEST_TIMEOUT_S,
    SHAPED_RTT_MS,
    SHAPED_STARTUP_TIMEOUT_S,
    CheckResult,
    RunningDeployment,
    ServerProfile,
    broken_hook_site,
    bundle_env,
    extended,
    hook_report,
    hook_report_problems,
    http,
    metric_sum,
    output_mismatch,
    parse_answer,
    profile_for,
    prompt_ids,
    request_body,
    request_cases,
    route_header,
    start_deployment,
    start_reference,
    summary,
    unpack,
    unroutable,
    wait_reference,
    wait_routable,
)
from prfaas_sglang.gpu.netlink import ShapedNamespace


@dataclass
class Context:
    root: Path | None  # the unpacked bundle; None for the emulated dry run
    checkout: Path
    model_dir: Path
    procs: ProcessGroup
    work: Path
    log: Callable[[str], None]
    engine: str = "sglang"  # or "mock": the harness's dry run on emulated engines; "sglang-cpu": real SGLang on CPU
    profile: ServerProfile = GPU_PROFILE  # the servers' flags and the prompts' lengths
    reference: str = ""  # the plain server's URL; empty in the dry run
    dep: RunningDeployment | None = None
    vocab_size: int = 0
    answers: dict | None = None  # greedy-equal's router answers, for shaped-link's comparison
    shaped: ShapedNamespace | None = None  # where PrfaaS runs when shaped-link is asked for
    delay_unavailable: str | None = None  # why the shaped link gets no added round trip here (None: it does)
    broken_hook: subprocess.Popen | None = None  # the server started with a broken hook (hooks)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))


def preflight(root: Path, checkout: Path) -> dict:
    """Versions of what the servers will import, from the bundle's environment; raises when any fails."""
    code = ("import json, importlib.metadata as m, torch\n"
            "import sglang, sgl_kernel, mooncake.engine, flashinfer.sampling, prfaas_sglang.plugin\n"
            "import sglang.srt.server_args, sglang.srt.entrypoints.http_server  # what a server imports first\n"
            "v = {d: m.version(d) for d in ('torch', 'transformers', 'sglang', 'sglang-kernel', "
            "'mooncake-transfer-engine-cuda13', 'flashinfer-python', 'prfaas-sglang')}\n"
            "v['cuda'] = torch.version.cuda; v['gpu'] = torch.cuda.get_device_name(0)\n"
            "v['plugins'] = sorted(e.name for e in m.entry_points(group='sglang.srt.plugins'))\n"
            "print(json.dumps(v))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=bundle_env(root, checkout),
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the bundle does not import here: {proc.stderr.strip()[-1500:]}")
    versions = json.loads(proc.stdout.strip().splitlines()[-1])
    if "prfaas" not in versions["plugins"]:
        raise RuntimeError(f"our sglang.srt.plugins entry point is not visible: {versions['plugins']}")
    return versions


def _ask(url: str, case: dict, ids: list[int], text: str | None, *, model: str) -> tuple[dict, dict]:
    status, headers, payload = http("POST", url + case["endpoint"], request_body(case, ids, text, model))
    if status != 200:
        raise RuntimeError(f"{case['name']} at {url}: HTTP {status} {payload[:300]!r}")
    return parse_answer(case["endpoint"], case["stream"], payload), headers


def start_broken_hook(ctx: Context) -> subprocess.Popen:
    """Start a plain server whose plugin carries a hook that cannot apply (``broken-hook`` in
    ``ctx.procs``); it must stop at start-up, which :func:`check_hooks` reads."""
    site = broken_hook_site(ctx.work / "broken-hook")
    env = bundle_env(ctx.root, ctx.checkout, profile=ctx.profile)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    ctx.broken_hook = ctx.procs.start(
        "broken-hook", [sys.executable, "-m", "prfaas_sglang.launch", "--role", "single", "--model-path",
                        str(ctx.model_dir), "--port", str(free_port()), "--", *ctx.profile.flags], base_env=env)
    return ctx.broken_hook


def start_checks_deployment(ctx: Context, stack: contextlib.ExitStack, shaped: bool, switchable: bool = False) -> RunningDeployment:
    """The one deployment every check uses. PrfaaS's prefix cache pinned to ``shared`` (the launcher's
    default is ``auto``, which keeps one-offs while it has seen too few re-sightings): kv-index and
    state-events check transfer cache. With ``shaped``: a namespace behind a :data:`SHAPED_RATE_MBIT`
    veth (entered on ``stack``, removed when it closes) holds PrfaaS, every other node on the veth's
    host end (not loopback, which inside the namespace is the namespace's own), SGLang's KV endpoints
    pinned there too (its own address lookup could pick another local address), the topology
    stating the longest round trip the link will have (the WAN profile's stall bound scales with it),
    and PrfaaS starts in the first of :data:`SHAPED_PROFILES`. ``switchable``: a second PD prefill, both
    ``role_switch: in-place`` (role-switch)."""
    from prfaas_sglang.gpu.netlink import delay_unavailable, shaped_namespace

    cache = {"PRFAAS_PREFILL_CACHE": "shared"}
    if not shaped:
        return start_deployment(ctx.root, ctx.checkout, ctx.model_dir, ctx.procs, ctx.work, prfaas_env=cache,
                                engine=ctx.engine, profile=ctx.profile, switchable=switchable)
    ns = ctx.shaped = stack.enter_context(shaped_namespace("prfaas-e2e", SHAPED_RATE_MBIT))
    ctx.delay_unavailable = delay_unavailable()
    _, kv_profile, env = SHAPED_PROFILES[0]
    return start_deployment(ctx.root, ctx.checkout, ctx.model_dir, ctx.procs, ctx.work, kv_profile=kv_profile,
                            host=ns.host_ip, prfaas_preexec=ns.enter, prfaas_host=ns.inner_ip,
                            prfaas_env={**cache, "SGLANG_HOST_IP": ns.inner_ip}, profile_env=env,
                            pd_env={"SGLANG_HOST_IP": ns.host_ip},
                            link=(SHAPED_RATE_MBIT / 1000, SHAPED_RTT_MS if ctx.delay_unavailable else SHAPED_DELAY_RTT_MS),
                            startup_timeout_s=SHAPED_STARTUP_TIMEOUT_S, engine=ctx.engine, profile=ctx.profile,
                            switchable=switchable)


def check_hooks(ctx: Context) -> CheckResult:
    from prfaas_sglang.plugin import HOOKS

    names = [h.name for h in HOOKS if h.applies()]  # the installed release's
    missing = {}
    for name in (*ctx.dep.engines(), "reference"):
        path = hook_report(ctx.work, name)
        lines = path.read_text().splitlines() if path.exists() else []
        if problems := hook_report_problems(lines, names):
            missing[name] = problems
    if missing:
        return CheckResult("hooks", False, f"hook reports: {missing}")
    proc = ctx.broken_hook or start_broken_hook(ctx)
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        ctx.procs.kill("broken-hook")
        return CheckResult("hooks", False, "a server with a broken hook did not stop within 300 s")
    log = ctx.procs.log("broken-hook")
    if code == 0 or "deliberately-broken" not in log or "does not resolve" not in log:
        return CheckResult("hooks", False, f"a broken hook: exit {code}, message not found in its log")
    line = next(x for x in log.splitlines() if "deliberately-broken" in x)
    return CheckResult("hooks", True, data={"hooks": names, "broken_exit": code, "broken_message": line[-300:]})


def check_greedy_equal(ctx: Context) -> CheckResult:
    tok = ctx.tokenizer()
    ctx.vocab_size = len(tok)
    router = ctx.dep.url("router")
    failures, routes, answers = [], {}, {}
    for case in request_cases(ctx.vocab_size, ctx.profile):
        ids = prompt_ids(case["num_tokens"], ctx.vocab_size, case["seed"])
        text = tok.decode(ids)
        ref, _ = _ask(ctx.reference, case, ids, text, model=ctx.profile.served_name)
        ours, headers = _ask(router, case, ids, text, model=ctx.profile.served_name)
        answers[case["name"]] = ours
        routes[case["name"]] = route_header(headers)
        why = output_mismatch(ours, ref)
        if why:
            failures.append(f"{case['name']}: {why}")
    ctx.answers = answers
    if failures:
        return CheckResult("greedy-equal", False, f"{len(failures)} of {len(answers)} differ; first: {failures[0]}",
                           {"routes": routes})
    return CheckResult("greedy-equal", True, data={"cases": len(answers), "routes": routes})


def check_routing(ctx: Context) -> CheckResult:
    router = ctx.dep.url("router")
    pd_prefill = ctx.dep.engines("pd-prefill")
    before = {n: http("GET", ctx.dep.url(n) + "/metrics")[2].decode() for n in ctx.dep.engines()}
    router_before = http("GET", router + "/metrics")[2].decode()
    wrong = []
    sent = {"prfaas": 0, "pd": 0}
    for i, num_tokens in enumerate(ctx.profile.short_tokens + ctx.profile.long_tokens):
        case = {"name": f"route-{num_tokens}", "endpoint": "/v1/completions", "stream": False}
        ids = prompt_ids(num_tokens, ctx.vocab_size or 4096, 1000 + i)
        _, headers = _ask(router, case, ids, None, model=ctx.profile.served_name)
        route = route_header(headers) or ""
        want = "prfaas" if num_tokens >= ctx.profile.threshold_tokens else "pd"  # the header and metrics name the kind
        sent[want] += 1
        if not route.startswith(want + "/"):
            wrong.append(f"{num_tokens} tokens went to {route!r}, the threshold says {want}")
    after = {n: http("GET", ctx.dep.url(n) + "/metrics")[2].decode() for n in before}
    router_after = http("GET", router + "/metrics")[2].decode()
    exported = any("sglang:num_requests_total" in text for text in after.values())
    served = {n: metric_sum(after[n], "sglang:num_requests_total") - metric_sum(before[n], "sglang:num_requests_total")
              for n in before}
    routed = {c: metric_sum(router_after, "prfaas_router_routed_total", f'cluster="{c}"')
              - metric_sum(router_before, "prfaas_router_routed_total", f'cluster="{c}"') for c in ("prfaas", "pd")}
    if routed != sent:
        wrong.append(f"router counters {routed} != sent {sent}")
    # SGLang's own request counter is its tokenizer manager's (health checks not counted); it was missing
    # while our plugin's early prometheus_client import kept that process's metrics in-process
    # (hook metrics-multiproc-values)
    if not exported:
        wrong.append("no engine exports sglang:num_requests_total (its HTTP process's metrics do not reach /metrics)")
    elif (served["prfaas-0"] != sent["prfaas"] or sum(served[n] for n in pd_prefill) != sent["pd"]
          or served["pd-decode-0"] != sum(sent.values())):
        wrong.append(f"engine request counters {served} disagree with sent {sent} (decode serves all)")
    data = {"routed": routed, "engines": served if exported else None}
    return CheckResult("routing", not wrong, "; ".join(wrong), data)


def check_kv_index(ctx: Context) -> CheckResult:
    router, index = ctx.dep.url("router"), ctx.dep.url("kv-index")
    wrong, rows = [], []
    base = prompt_ids(2048, ctx.vocab_size or 4096, 777)
    # Three sightings of a prompt, then an extension of it: every time the kv-index's prediction must
    # equal what the engine reports (a PrfaaS worker keeps a prefill only once its prefix was seen
    # before: PRFAAS_PREFILL_CACHE=shared, pinned by run), and the extension must hit.
    more = extended(base, 1024, ctx.vocab_size or 4096, 778)
    for label, ids in (("first", base), ("second", base), ("repeat", base), ("extend", more)):
        time.sleep(1.0)  # KV events are published after the request; let them land
        predicted = json.loads(http("POST", index + "/match", {"input_ids": ids})[2])
        case = {"name": f"kv-{label}", "endpoint": "/v1/completions", "stream": False}
        answer, headers = _ask(router, case, ids, None, model=ctx.profile.served_name)
        route = route_header(headers) or ""
        prefill = route.split("/")[1] if route.count("/") >= 2 else ""
        expect = predicted["by_worker"].get(prefill, 0)
        rows.append({"prompt": label, "predicted": expect, "cached_tokens": answer["cached_tokens"], "prefill": prefill})
        if answer["cached_tokens"] is None or expect != answer["cached_tokens"]:
            wrong.append(f"{label}: kv-index predicts {expect} reusable tokens on {prefill}, the engine reports "
                         f"cached_tokens {answer['cached_tokens']}")
    # On a hybrid model an exact repeat may reuse nothing: a prefix is reusable only where a Mamba state
    # was kept, and the state sits at the prompt's end, past the last token a repeat may take from cache
    # (the emulated engine: 1536 tokens held, 0 reusable). The extension starts with the whole prompt.
    if rows[-1]["cached_tokens"] in (0, None):
        wrong.append("the extended prompt hit no cache: the check shows nothing")
    return CheckResult("kv-index", not wrong, "; ".join(wrong), {"rows": rows})


def _index_worker(index: str, name: str) -> dict:
    return json.loads(http("GET", index + "/status")[2])["workers"].get(name, {})


def check_cache_move(ctx: Context) -> CheckResult:
    """A prefix cached on a PD prefill server only, moved to the PrfaaS server through the routes the
    cache-move hooks add (a real server on each end, Mooncake TCP between them, SGLang's own tree
    on each side): the import answers with the tokens it took, an import of it again takes none,
    the kv-index sees them stored on PrfaaS, and a longer prompt sent there through the router reuses
    them (SGLang's own ``cached_tokens``)."""
    from prfaas_sglang.wire.cache_move import CacheImport, CacheImported

    router, index, vocab = ctx.dep.url("router"), ctx.dep.url("kv-index"), ctx.vocab_size or 4096
    case = {"name": "cache-move", "endpoint": "/v1/completions", "stream": False}
    ids = prompt_ids(ctx.profile.short_tokens[1], vocab, 951)  # short: a PD prefill computes and keeps it
    _, headers = _ask(router, case, ids, None, model=ctx.profile.served_name)
    source = (route_header(headers) or "").split("/")
    if len(source) != 3 or source[0] != "pd":
        return CheckResult("cache-move", False, f"the short prompt was routed {route_header(headers)!r}, not to PD")
    time.sleep(1.0)
    before = _index_worker(index, "prfaas-0").get("blocks", 0)
    body = CacheImport(ids, len(ids), ctx.dep.url(source[1]), 60.0).to_json()
    answers = [http("POST", ctx.dep.url("prfaas-0") + "/prfaas/cache/import", body) for _ in range(2)]
    data: dict = {"source": source[1], "tokens": len(ids), "answers": [[a[0], a[2][:300].decode(errors="replace")]
                                                                       for a in answers]}
    if any(status != 200 for status, _, _ in answers):
        return CheckResult("cache-move", False, f"import answered {[a[0] for a in answers]}: {data['answers']}", data)
    first, again = (CacheImported.decode(json.loads(payload)) for _, _, payload in answers)
    time.sleep(1.0)
    after = _index_worker(index, "prfaas-0").get("blocks", 0)
    longer = extended(ids, ctx.profile.long_tokens[0], vocab, 952)  # long: to PrfaaS, past its moved prefix
    answer, headers = _ask(router, case, longer, None, model=ctx.profile.served_name)
    data.update(imported_tokens=first.imported_tokens, bytes=first.bytes, transfer_s=first.transfer_s,
                again_imported=again.imported_tokens, again_cached=again.cached_tokens, blocks_before=before,
                blocks_after=after, longer_route=route_header(headers), longer_cached_tokens=answer["cached_tokens"])
    wrong = []
    if first.imported_tokens < len(ids) // 2:
        wrong.append(f"the import took {first.imported_tokens} of {len(ids)} tokens")
    if again.imported_tokens != 0 or again.cached_tokens < first.imported_tokens:
        wrong.append(f"importing it again took {again.imported_tokens} tokens, held {again.cached_tokens}")
    if after <= before:
        wrong.append(f"the kv-index saw no blocks stored on prfaas-0 ({before} -> {after})")
    if not (route_header(headers) or "").startswith("prfaas/prfaas-0/"):
        wrong.append(f"the longer prompt went {route_header(headers)!r}, not to prfaas-0")
    elif answer["cached_tokens"] < first.imported_tokens:
        wrong.append(f"prfaas-0 reused {answer['cached_tokens']} tokens of the {first.imported_tokens} moved to it")
    return CheckResult("cache-move", not wrong, "; ".join(wrong), data)


def check_state_events(ctx: Context) -> CheckResult:
    """Issue #15 on real SGLang: both prefill workers report their Mamba state checkpoints (the
    ``prfaas-hybrid`` cache and ``prfaas-zmq`` publisher are live); a PrfaaS worker (pinned to
    ``PRFAAS_PREFILL_CACHE=shared`` by :func:`run`) keeps no one-off long prompt (transfer cache: no page of it is published as stored) and keeps a prompt
    seen twice, which its extension then hits (an exact repeat may not, on a hybrid: the state sits at
    the prompt's end)."""
    router, index = ctx.dep.url("router"), ctx.dep.url("kv-index")
    vocab, wrong, data = ctx.vocab_size or 4096, [], {}
    case = {"name": "state", "endpoint": "/v1/completions", "stream": False}
    _ask(router, case, prompt_ids(1024, vocab, 901), None, model=ctx.profile.served_name)  # to PD-P, whose tree keeps everything
    time.sleep(1.0)
    wrong += _state_reports_problems(data, index, "pd-prefill-0")
    before = _index_worker(index, "prfaas-0").get("blocks", 0)
    for i in range(3):  # one-off long prompts: transfer cache only
        _ask(router, case, prompt_ids(ctx.profile.long_tokens[0], vocab, 910 + i), None, model=ctx.profile.served_name)
    time.sleep(1.0)
    after_unique = _index_worker(index, "prfaas-0").get("blocks", 0)
    if after_unique != before:
        wrong.append(f"prfaas-0 published {after_unique - before} stored blocks for 3 one-off prompts (transfer "
                     "cache must not be inserted)")
    # A prompt sent twice (its second sighting is kept), then extended, as a conversation's next turn
    # is: on a hybrid model an exact repeat reuses nothing when the Mamba state sits at the prompt's end
    # (the H100, 2026-11-26: the repeat's 8,192 tokens were stored, cached_tokens [0, 0, 0]). The
    # extension is long enough that its uncached part still goes to PrfaaS.
    shared = prompt_ids(ctx.profile.long_tokens[0], vocab, 920)
    sends = (shared, shared, extended(shared, ctx.profile.long_tokens[0], vocab, 921))
    answers = [_ask(router, case, ids, None, model=ctx.profile.served_name) for ids in sends]
    cached = [answer["cached_tokens"] for answer, _ in answers]
    time.sleep(1.0)
    data.update(blocks_before=before, blocks_after_unique=after_unique, cached_tokens_twice_then_extended=cached,
                routes=[route_header(headers) for _, headers in answers],
                blocks_after_shared=_index_worker(index, "prfaas-0").get("blocks", 0))
    if cached[2] < ctx.profile.long_tokens[0] // 2:
        wrong.append(f"a long prompt sent twice was not reused by its extension on prfaas-0: cached_tokens {cached}")
    # PrfaaS's reports are read once it stored something: run alone, this check finds its tree empty
    # until the shared prompt (H100, 2026-11-26: 'inferred', no blocks, before it)
    wrong += _state_reports_problems(data, index, "prfaas-0")
    return CheckResult("state-events", not wrong, "; ".join(wrong), data)


def _state_reports_problems(data: dict, index: str, name: str) -> list[str]:
    """Records the kv-index's view of ``name`` in ``data``; what is wrong with it for a worker that
    holds a prefilled prompt: checkpoints not reported by its cache, or none at all."""
    data[name] = _index_worker(index, name)
    if data[name].get("checkpoints_from") != "reported":
        return [f"{name}: checkpoints {data[name].get('checkpoints_from')!r}, not reported by its cache"]
    if not data[name].get("checkpoints"):
        return [f"{name} holds a prefilled prompt but reported no state checkpoint"]
    return []


def check_failover(ctx: Context) -> CheckResult:
    """The PrfaaS server killed while long requests are in flight (at the first answer: on an H100 a
    fixed 1.5 s came after all 16 had finished, 2026-11-26): every request completes via PD-P or
    fails with a clear error; none hangs; the router reports the worker down. A kill that found no
    request in flight shows nothing and fails the check."""
    router = ctx.dep.url("router")
    long_case = {"name": "failover", "endpoint": "/v1/completions", "stream": True}

    def one(i: int) -> dict:
        ids = prompt_ids(ctx.profile.long_tokens[0], ctx.vocab_size or 4096, 5000 + i)
        started = time.monotonic()
        try:
            status, _, payload = http("POST", router + "/v1/completions", request_body(long_case, ids, None, ctx.profile.served_name),
                                      timeout_s=180)
        except OSError as err:
            return {"ok": False, "hung": "timed out" in str(err), "why": str(err), "t0": started, "t1": time.monotonic()}
        if status != 200:
            return {"ok": False, "status": status, "why": payload[:200].decode(errors="replace"),
                    "clear": b"message" in payload, "t0": started, "t1": time.monotonic()}
        try:
            parse_answer("/v1/completions", True, payload)
        except ValueError as err:
            return {"ok": False, "why": str(err), "streamed_error": True, "t0": started, "t1": time.monotonic()}
        return {"ok": True, "t0": started, "t1": time.monotonic()}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        began = time.monotonic()
        futures = [pool.submit(one, i) for i in range(16)]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        killed_at = time.monotonic()
        ctx.procs.kill("prfaas-0")
        later = [pool.submit(one, 100 + i) for i in range(8)]
        outcomes = [f.result() for f in futures + later]
    status = json.loads(http("GET", router + "/status")[2])
    metrics = http("GET", router + "/metrics")[2].decode()
    hung = [o for o in outcomes if o.get("hung")]
    unclear = [o for o in outcomes if not o["ok"] and not o.get("clear")]
    in_flight = [o for o in outcomes[:16] if o["t0"] < killed_at < o["t1"]]
    data = {"completed": sum(o["ok"] for o in outcomes), "failed": sum(not o["ok"] for o in outcomes),
            "in_flight_at_kill": len(in_flight), "in_flight_completed": sum(o["ok"] for o in in_flight),
            "redispatched": metric_sum(metrics, "prfaas_router_redispatched_total"),
            "kill_after_s": round(killed_at - began, 2),
            "last_answer_after_kill_s": round(max(o["t1"] for o in outcomes) - killed_at, 2),
            "prfaas_healthy": (status.get("workers") or {}).get("prfaas-0", {}).get("healthy")}
    problems = []
    if not in_flight:
        problems.append("no request was in flight when prfaas-0 was killed: the check shows nothing")
    if hung:
        problems.append(f"{len(hung)} request(s) hung")
    if unclear:
        problems.append(f"{len(unclear)} failure(s) without a clear error: {unclear[0]['why'][:120]}")
    if data["prfaas_healthy"] is not False:
        problems.append(f"the router does not report prfaas-0 down ({data['prfaas_healthy']})")
    return CheckResult("failover", not problems, "; ".join(problems), data)


# (name, --kv-profile, environment): the last is the profile the other checks run with
SHAPED_PROFILES = (("upstream", "upstream", None), ("wan-layerwise", "wan", {"PRFAAS_KV_LAYERWISE": "1"}),
                   ("wan", "wan", None))


def _reference_answer(ctx: Context, case: dict, ids: list[int]) -> dict | None:
    """The plain server's answer (greedy-equal's when it ran), the unshaped truth to compare to;
    None in the dry run until a first profile answered (its answer is then the reference)."""
    known = (ctx.answers or {}).get(case["name"])
    if known is not None or not ctx.reference:
        return known
    wait_reference(ctx.procs, ctx.reference)
    return _ask(ctx.reference, case, ids, None, model=ctx.profile.served_name)[0]


def _ttft_s(router: str, ids: list[int], model: str) -> tuple[float, int, str | None]:
    """(seconds to the whole one-token answer, HTTP status, route) of a streamed ``max_tokens: 1``
    completion: the prefill, the KV's crossing and the first decode step."""
    case = {"name": "ttft", "endpoint": "/v1/completions", "stream": True}
    started = time.monotonic()
    status, headers, _ = http("POST", router + "/v1/completions", {**request_body(case, ids, None, model),
                                                                   "max_tokens": 1}, timeout_s=SHAPED_REQUEST_TIMEOUT_S)
    return time.monotonic() - started, status, route_header(headers)


def _timed_prompts(ctx: Context, router: str, profile: str, link: str, seed: int) -> tuple[list[dict], list[str]]:
    """On the link as it is now (``link`` names it in the rows): a warm-up prompt per length (kernels
    compile on first use, the lanes open), then ``ctx.profile.shaped_repeats`` fresh prompts per
    length timed (seeds from ``seed``: a link's prompts are none of another's, so none is a second
    sighting the PrfaaS cache would keep), each of which must go to PrfaaS."""
    rows, problems, vocab = [], [], ctx.vocab_size or 4096
    for num_tokens in ctx.profile.long_tokens:
        warm_s, _, _ = _ttft_s(router, prompt_ids(num_tokens, vocab, seed - 1_000 + num_tokens), ctx.profile.served_name)
        if (waited_s := wait_routable(router)) > 1.0:  # the warm-up's compile outlasted a health check
            ctx.log(f"[shaped-link] {profile}: waited {waited_s:.1f} s for the router to route to every worker")
        for k in range(ctx.profile.shaped_repeats):
            ttft_s, status, route = _ttft_s(router, prompt_ids(num_tokens, vocab, seed + num_tokens * 10 + k),
                                             ctx.profile.served_name)
            row = {"profile": profile, "link": link, "tokens": num_tokens, "repeat": k, "ttft_s": round(ttft_s, 3),
                   "warmup_s": round(warm_s, 3), "status": status, "route": route}
            ctx.log(f"[shaped-link] {json.dumps(row)}")
            rows.append(row)
            if status != 200 or not (route or "").startswith("prfaas/"):  # {cluster kind}/{prefill}/{decode}
                with contextlib.suppress(OSError, ValueError):
                    row["router_says"] = why_routed(json.loads(http("GET", router + "/status", timeout_s=5)[2]), num_tokens)
                problems.append(f"{profile} {link} {num_tokens}: status {status}, route {route!r} (want prfaas/...)"
                                + (f"; the router: {row['router_says']}" if row.get("router_says") else ""))
    return rows, problems


def why_routed(status: dict, num_tokens: int) -> str:
    """The router's own account (its ``/status``) of its latest decision for a ``num_tokens`` prompt:
    the attempts' clusters and reasons, and what could have kept a worker out (:func:`unroutable`) or
    the request waiting (decode room), with the threshold controller's capacity estimate (pure)."""
    mine = [r for r in status.get("recent") or [] if r.get("tokens") == num_tokens]
    if mine:
        rid = mine[-1].get("rid")
        mine = [r for r in mine if r.get("rid") == rid]
    parts = [f"attempt {r.get('attempt')}: {r.get('cluster')} ({r.get('reason')})" for r in mine]
    if out := unroutable(status):
        parts.append(f"out of routing: {', '.join(out)}")
    decodes = {n: w for n, w in (status.get("workers") or {}).items() if w.get("role") == "decode"}
    parts += [f"{n}: {w.get('kv_free_tokens')} KV tokens free, {w.get('reserved_tokens')} reserved" for n, w in decodes.items()]
    estimate = (status.get("controller") or {}).get("capacity_est_bps")
    if estimate is not None:
        parts.append(f"capacity estimate {estimate / 1e6:.3g} Mbit/s")
    return "; ".join(parts) or f"no decision for {num_tokens} tokens among the recent ones"


class _LinkWatch:
    """While open, the router's view of the PrfaaS link (``/status`` ``link``, built from the PrfaaS
    worker's telemetry, a window of about a second) read every 0.25 s in a thread; :meth:`summary`
    after: samples, those with a capacity measured, the peak capacity and egress, transfers seen
    delivered and failed (summed over samples, so a transfer can count more than once), samples
    flagged congested, the controller's capacity estimate at the end and its lowest, and the probes
    the router sent meanwhile."""

    def __init__(self, router: str):
        self.router, self.views, self._stop = router, [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="shaped-link-watch", daemon=True)

    def __enter__(self) -> _LinkWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            with contextlib.suppress(OSError, ValueError):
                self.views.append(json.loads(http("GET", self.router + "/status", timeout_s=5)[2]))

    def summary(self) -> dict:
        links = [v.get("link") or {} for v in self.views]
        measured = [link["capacity_bps"] for link in links if link.get("capacity_bps")]
        last = self.views[-1] if self.views else {}
        estimates = [e for v in self.views if (e := (v.get("controller") or {}).get("capacity_est_bps")) is not None]
        return {"samples": len(links), "with_capacity": len(measured),
                "peak_capacity_bps": max(measured, default=None),
                "peak_egress_bps": max((link.get("egress_bps") or 0.0 for link in links), default=0.0),
                "transfers_delivered_seen": sum(link.get("transfers_completed") or 0 for link in links),
                "transfers_failed_seen": sum(link.get("transfers_failed") or 0 for link in links),
                "congested_samples": sum(bool(link.get("congested")) for link in links),
                "controller_capacity_est_bps": (last.get("controller") or {}).get("capacity_est_bps"),
                "lowest_capacity_est_bps": min(estimates, default=None),
                "probes": (last.get("probes") or 0) - (self.views[0].get("probes") or 0) if self.views else 0}


def _shaped_profile(ctx: Context, profile: str, delay_rtt_ms: float | None, first_seed: int) -> tuple[list[dict], list[str], list[dict]]:
    """On the deployment as it runs (PrfaaS in ``profile``): :func:`_timed_prompts` on the bare veth,
    then, with ``delay_rtt_ms``, again with that round trip added (netem), then the
    seed-``num_tokens`` prompt's 16-token answer compared with the reference's. Prompts are seeded from
    ``first_seed``, one million per link: a profile's prompts are none of another's, or a prompt that
    went to PD-P once would rightly go there again (its prefix cached there)."""
    from prfaas_sglang.gpu.netlink import set_delay

    rows, problems, telemetry = [], [], []
    router = ctx.dep.url("router")
    links = [("veth", None)] + ([(f"rtt-{delay_rtt_ms:g}ms", delay_rtt_ms)] if delay_rtt_ms else [])
    try:
        for index, (link, rtt_ms) in enumerate(links):
            if delay_rtt_ms:
                set_delay(rtt_ms)
            with _LinkWatch(router) as watch:  # what the PrfaaS worker's link telemetry told the router (#14)
                got, wrong = _timed_prompts(ctx, router, profile, link, seed=first_seed + 1_000_000 * index)
            seen = {"profile": profile, "link": link, **watch.summary()}
            ctx.log(f"[shaped-link] the router's link view: {json.dumps(seen)}")
            rows, problems, telemetry = rows + got, problems + wrong, telemetry + [seen]
            if not seen["with_capacity"]:
                problems.append(f"{profile} {link}: the router measured no link capacity from prfaas-0's telemetry "
                                f"in {seen['samples']} samples")
    except Exception as err:  # noqa: BLE001 - one profile's failure is reported; the others still run
        problems.append(f"{profile}: {type(err).__name__}: {err}")
        ctx.log(f"[shaped-link] {profile} failed: {type(err).__name__}: {err}")
    finally:
        if delay_rtt_ms:
            set_delay(None)
    try:
        for num_tokens in ctx.profile.long_tokens:
            case = {"name": f"completions-{num_tokens}-stream", "endpoint": "/v1/completions", "stream": True}
            ids = prompt_ids(num_tokens, ctx.vocab_size or 4096, num_tokens)
            ours, _ = _ask(router, case, ids, None, model=ctx.profile.served_name)
            reference = _reference_answer(ctx, case, ids)
            if reference is None:
                ctx.answers = {**(ctx.answers or {}), case["name"]: ours}
            elif why := output_mismatch(ours, reference):
                problems.append(f"{profile} {num_tokens}: {why}")
    except Exception as err:  # noqa: BLE001
        problems.append(f"{profile} answers: {type(err).__name__}: {err}")
    return rows, problems, telemetry


def shaped_medians(rows: list[dict]) -> dict:
    """``{profile: {tokens: median TTFT s}}`` and each profile's ratio to ``upstream`` (pure)."""
    import statistics

    medians: dict = {}
    for row in rows:
        if row["status"] == 200:
            medians.setdefault(row["profile"], {}).setdefault(row["tokens"], []).append(row["ttft_s"])
    medians = {p: {t: round(statistics.median(v), 3) for t, v in by.items()} for p, by in medians.items()}
    base = medians.get("upstream", {})
    ratios = {p: {t: round(v / base[t], 3) for t, v in by.items() if base.get(t)} for p, by in medians.items()}
    return {"median_ttft_s": medians, "ratio_to_upstream": ratios}


def check_shaped_link(ctx: Context) -> CheckResult:
    """TTFT over a rate-shaped veth for SGLang's Mooncake settings, our WAN profile with layer-wise
    streaming, and our WAN profile (:data:`SHAPED_PROFILES`, in that order: the last is the one the
    other checks then use), on the bare veth and, where the kernel has netem, with
    :data:`SHAPED_DELAY_RTT_MS` of round trip added; outputs identical to the unshaped reference.
    The deployment is the shared one (PrfaaS already behind the veth); a profile switch restarts
    the PrfaaS server alone."""
    if ctx.shaped is None or ctx.dep is None:
        return CheckResult("shaped-link", False, "the deployment was not started behind the shaped link")
    ctx.vocab_size = ctx.vocab_size or len(ctx.tokenizer())
    if ctx.delay_unavailable is not None:
        ctx.log(f"[shaped-link] the bare veth only: {ctx.delay_unavailable}")
    delay_rtt_ms = None if ctx.delay_unavailable else SHAPED_DELAY_RTT_MS
    rows, problems, telemetry, restarts_s = [], [], [], {}
    for number, (profile, kv_profile, env) in enumerate(SHAPED_PROFILES):
        if ctx.dep.prfaas_profile != (kv_profile, tuple(sorted((env or {}).items()))):
            try:
                restarts_s[profile] = round(ctx.dep.restart_prfaas(kv_profile, env), 1)
            except Exception as err:  # noqa: BLE001 - this profile is lost; the next restart tries again
                problems.append(f"{profile}: prfaas-0 did not restart: {type(err).__name__}: {err}")
                continue
            ctx.log(f"[shaped-link] prfaas-0 restarted as {profile}, routable after {restarts_s[profile]} s")
        got, wrong, seen = _shaped_profile(ctx, profile, delay_rtt_ms, first_seed=8_000_000 + 10_000_000 * number)
        rows, problems, telemetry = rows + got, problems + wrong, telemetry + seen
    by_link = {link: shaped_medians([r for r in rows if r["link"] == link]) for link in dict.fromkeys(r["link"] for r in rows)}
    ctx.log(f"[shaped-link] {json.dumps(by_link)}")
    data = {"rate_mbit": SHAPED_RATE_MBIT, "veth_rtt_ms": SHAPED_RTT_MS, "delay_rtt_ms": delay_rtt_ms,
            "no_delay_because": ctx.delay_unavailable, "repeats": ctx.profile.shaped_repeats, "rows": rows,
            **by_link.get("veth", shaped_medians([])), "by_link": by_link, "router_link_view": telemetry,
            "prfaas_restart_s": restarts_s}
    return CheckResult("shaped-link", not problems, "; ".join(problems), data)


ROLE_SWITCH_WORKER = "pd-prefill-1"  # the second PD prefill of a switchable deployment (e2e.pd_prefill_names)
ROLE_SWITCH_LOAD_GAP_S = 0.5  # each of two clients: its next short prompt this long after an answer
ROLE_SWITCH_SERVED = 3  # answers the converted worker must serve in each new role (its peer drained meanwhile)
ROLE_SWITCH_SERVE_TIMEOUT_S = 120.0


def _role_switch_load(ctx: Context, router: str, client: int, stop: threading.Event, answers: list[dict]) -> None:
    """Short prompts (PD) from one client until ``stop``, each answer's status and route into ``answers``."""
    case = {"name": "role-switch", "endpoint": "/v1/completions", "stream": False}
    for i in range(10_000):
        if stop.is_set():
            return
        ids = prompt_ids(ctx.profile.short_tokens[0], ctx.vocab_size or 4096, 20_000 + 1_000 * client + i)
        started = time.monotonic()
        try:
            status, headers, payload = http("POST", router + "/v1/completions",
                                            request_body(case, ids, None, ctx.profile.served_name), timeout_s=180)
            why = None if status == 200 else payload[:200].decode(errors="replace")
        except OSError as err:
            status, headers, why = None, {}, str(err)
        answers.append({"status": status, "route": route_header(headers), "why": why, "t0": started,
                        "t1": time.monotonic()})
        stop.wait(ROLE_SWITCH_LOAD_GAP_S)


def _role_switch_step(ctx: Context, router: str, new_role: str) -> dict:
    """One conversion through the router's admin API, then the worker's own view and the router's record."""
    name, began = ROLE_SWITCH_WORKER, time.monotonic()
    status, _, body = http("POST", router + f"/admin/workers/{name}/role", {"new_role": new_role, "drain_timeout_s": 120},
                           timeout_s=300, headers=ADMIN_HEADERS)
    step = {"to": new_role, "status": status, "seconds": round(time.monotonic() - began, 2)}
    try:
        step["reply"] = json.loads(body)
    except ValueError:
        step["reply"] = body[:300].decode(errors="replace")
    if status != 200:
        return step
    # the mode it runs now: /model_info (0.5.23's /server_info reports the startup configuration)
    step["server_mode"] = json.loads(http("GET", ctx.dep.url(name) + "/model_info")[2]).get("disaggregation_mode")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # re-adopted in its new role: healthy, its facts taken, not draining
        record = (json.loads(http("GET", router + "/status")[2]).get("workers") or {}).get(name, {})
        if (record.get("role") == new_role and record.get("healthy") and record.get("page_size")
                and not record.get("refused") and not record.get("draining")):
            step["readopted_s"] = round(time.monotonic() - began, 2)
            break
        time.sleep(0.5)
    step["router_role"], step["router_refused"] = record.get("role"), record.get("refused")
    return step


def _served_in_role(ctx: Context, router: str, new_role: str, answers: list[dict]) -> dict:
    """With the converted worker's one peer in its new role drained (the router routes around it), the
    answers it serves in that role, up to :data:`ROLE_SWITCH_SERVED`; the peer is back in service after."""
    name, peer = ROLE_SWITCH_WORKER, "pd-decode-0" if new_role == "decode" else "pd-prefill-0"
    since = time.monotonic()
    http("POST", router + f"/admin/workers/{peer}/drain", {"draining": True}, headers=ADMIN_HEADERS)
    try:
        deadline, served = since + ROLE_SWITCH_SERVE_TIMEOUT_S, []
        while time.monotonic() < deadline and len(served) < ROLE_SWITCH_SERVED:
            time.sleep(0.5)
            parts = [(a["route"] or "").split("/") for a in list(answers) if a["t0"] > since and a["status"] == 200]
            served = [p for p in parts if len(p) == 3 and p[2 if new_role == "decode" else 1] == name]
    finally:
        http("POST", router + f"/admin/workers/{peer}/drain", {"draining": False}, headers=ADMIN_HEADERS)
    return {"served": len(served), "peer_drained": peer, "serve_s": round(time.monotonic() - since, 1)}


def check_role_switch(ctx: Context) -> CheckResult:
    """SGLang's own ``/pd_role_switch`` (0.5.23, ``role_switch: in-place``) driven by the router under
    light load: two clients keep sending short prompts while the router's admin API turns
    ``pd-prefill-1`` into a decode worker and back. It serves requests as a prefill first (so the decode
    holds its endpoints), then in each new role (its peer in that role drained meanwhile, so the router
    must use it). Every request is answered 200; after each step the worker's own ``/model_info`` says
    its new mode and the router re-adopts it in that role."""
    from prfaas_sglang._compat import serves_pd_role_switch

    if not serves_pd_role_switch():
        return CheckResult("role-switch", False, "the installed SGLang has no /pd_role_switch (0.5.23 has)")
    router, stop, answers, steps, before = ctx.dep.url("router"), threading.Event(), [], [], {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(_role_switch_load, ctx, router, k, stop, answers) for k in range(2)]
        try:
            # first as the prefill it is, so that the decode caches its endpoints (what a switch back must undo)
            before = _served_in_role(ctx, router, "prefill", answers)
            for new_role in ("decode", "prefill"):
                steps.append(_role_switch_step(ctx, router, new_role))
                if steps[-1]["status"] != 200:
                    break
                steps[-1].update(_served_in_role(ctx, router, new_role, answers))
        finally:
            stop.set()
            for client in clients:
                client.result()
    lost = [a for a in answers if a["status"] != 200]
    data = {"served_before": before, "steps": steps, "requests": len(answers), "lost": len(lost)}
    problems = [f"to {s['to']}: {s['status']} {s['reply']}" for s in steps if s["status"] != 200]
    problems += [f"to {s['to']}: the worker says {s.get('server_mode')!r}, the router {s.get('router_role')!r} "
                 f"(refused: {s.get('router_refused')})"
                 for s in steps if s["status"] == 200 and not (s.get("server_mode") == s["to"] and "readopted_s" in s)]
    problems += [f"as {s['to']}: served {s['served']} of {ROLE_SWITCH_SERVED} requests in {s['serve_s']} s"
                 for s in ({**before, "to": "prefill (before)", "status": 200}, *steps)
                 if s["status"] == 200 and s.get("served", 0) < ROLE_SWITCH_SERVED]
    if len(steps) < 2 and not problems:
        problems.append("the switch back did not run")
    if lost:
        problems.append(f"{len(lost)} of {len(answers)} requests lost: {lost[0]['status']} {lost[0]['why']}")
    return CheckResult("role-switch", not problems, "; ".join(problems), data)


CHECK_FUNCTIONS: dict[str, Callable[[Context], CheckResult]] = {
    "hooks": check_hooks, "greedy-equal": check_greedy_equal, "routing": check_routing, "kv-index": check_kv_index,
    "state-events": check_state_events, "failover": check_failover, "shaped-link": check_shaped_link,
    "role-switch": check_role_switch, "cache-move": check_cache_move,
}


# --- the run ---------------------------------------------------------------------------------------


def run_order(checks: Iterable[str]) -> list[str]:
    """``shaped-link`` first (it switches the PrfaaS server's profile, ending on the one the others
    use), ``failover`` last (it kills the PrfaaS server), the others in the order asked."""
    checks = list(checks)
    first, last = [c for c in checks if c == "shaped-link"], [c for c in checks if c == "failover"]
    return first + [c for c in checks if c not in ("shaped-link", "failover")] + last


class DeploymentFailed(RuntimeError):
    """What :func:`deployment` needed did not start; the message names the cause."""


@contextlib.contextmanager
def deployment(engine: str, checks: Iterable[str], log: Callable[[str], None], *, bundle_dir: Path | None = None,
               model_config: Path | None = None, facts: dict | None = None) -> Iterator[Context]:
    """What ``checks`` run on, started once, as a :class:`Context`: the plain reference server where they need
    it (:data:`~prfaas_sglang.gpu.e2e.NEED_REFERENCE`; :func:`ensure_reference` starts it later for a caller
    that needs it for something else), the broken-hook server for ``hooks``, and the one deployment (shaped
    with ``shaped-link``, switchable with ``role-switch``). Every server is stopped, and the shaped namespace
    removed, when the block ends. ``engine``: ``sglang`` (the unpacked bundle's), ``sglang-cpu`` (this
    environment's SGLang on CPU; ``model_config``, else a tiny Llama made here) or ``mock`` (emulated
    engines: the harness's dry run). ``facts`` (a dict) gets the versions, the work and log directories,
    the seconds to a healthy deployment and what outlived its TERM. Raises :class:`DeploymentFailed`."""
    checks, began = tuple(checks), time.monotonic()
    facts = {} if facts is None else facts
    checkout, profile = Path(__file__).resolve().parents[2], profile_for(engine)
    root = unpack(bundle_dir) if engine == "sglang" else None
    if root is not None and str(root / "site") not in sys.path:  # this process too: what the machine lacks (aiohttp, zmq, ...)
        sys.path.append(str(root / "site"))
    work = Path(tempfile.mkdtemp(prefix="prfaas-gpu-e2e-"))
    if engine == "sglang-cpu" and model_config is None:
        from prfaas_sglang.gpu.tiny_model import make_model

        make_model(work / "model", cpu=True, log=log)
        model_config = work / "model"
    model_dir = model_config or (root / "model")
    procs = ProcessGroup(work / "logs")
    facts.update(work_dir=str(work), model=str(model_dir), engine=engine)
    with contextlib.ExitStack() as stack:  # the shaped namespace, removed after every server stopped
        try:
            ctx = Context(root, checkout, model_dir, procs, work, log, engine=engine, profile=profile)
            try:
                if engine == "sglang":
                    facts["versions"] = preflight(root, checkout)
                    log(f"[gpu-e2e] versions: {facts['versions']}")
                if engine != "mock" and set(checks) & NEED_REFERENCE:
                    ctx.reference = start_reference(root, checkout, model_dir, procs, wait=False, profile=profile)
                if engine != "mock" and "hooks" in checks:  # it stops at start-up: started now, read by the check
                    start_broken_hook(ctx)
                # One deployment for every check: with shaped-link, PrfaaS sits behind the shaped veth from
                # the start, and that check switches its profile by restarting that server alone.
                ctx.dep = start_checks_deployment(ctx, stack, shaped="shaped-link" in checks,
                                                  switchable="role-switch" in checks)
                if ctx.reference:
                    wait_reference(procs, ctx.reference)
            except Exception as err:  # noqa: BLE001 - whatever stopped the start is the cause every check reports
                raise DeploymentFailed(f"{type(err).__name__}: {err}") from err
            facts["deployment_healthy_s"] = round(time.monotonic() - began, 1)
            log(f"[gpu-e2e] deployment healthy after {facts['deployment_healthy_s']} s")
            yield ctx
        finally:
            facts["killed_after_term"] = procs.stop()
            facts["logs"] = str(procs.log_dir)


def run_checks(ctx: Context, checks: Iterable[str]) -> list[CheckResult]:
    """Run ``checks`` on ``ctx`` in :func:`run_order`, each logged as it ends; a check that crashes is its own
    FAIL, and the others still run. ``failover`` leaves the PrfaaS server down (:func:`restore` restarts it)."""
    results = []
    for name in run_order(checks):
        started = time.monotonic()
        try:
            result = CHECK_FUNCTIONS[name](ctx)
        except Exception as err:  # noqa: BLE001 - a check's crash is its FAIL line, the others still run
            result = CheckResult(name, False, f"{type(err).__name__}: {err}")
        result.data["seconds"] = round(time.monotonic() - started, 1)
        ctx.log(result.line())
        results.append(result)
    return results


def restore(ctx: Context) -> None:
    """Bring ``ctx``'s deployment back to how :func:`deployment` left it for the next user: the PrfaaS server
    restarted (in the profile it ran) if it is not healthy, as after ``failover``; returns once the router
    routes to every worker."""
    try:
        healthy = http("GET", ctx.dep.url("prfaas-0") + "/health", timeout_s=10)[0] == 200
    except OSError:  # no answer: killed
        healthy = False
    if not healthy:
        kv_profile, env = ctx.dep.prfaas_profile
        ctx.log(f"[gpu-e2e] prfaas-0 restarted after {ctx.dep.restart_prfaas(kv_profile, dict(env) or None):.1f} s")
    wait_routable(ctx.dep.url("router"))


def ensure_reference(ctx: Context) -> str:
    """The plain reference server's URL, started (and waited for) now if :func:`deployment` did not."""
    if not ctx.reference:
        ctx.reference = start_reference(ctx.root, ctx.checkout, ctx.model_dir, ctx.procs, wait=True, profile=ctx.profile)
    return ctx.reference


def run(bundle_dir: Path | None, model_config: Path | None, checks: tuple[str, ...], log: Callable[[str], None],
        engine: str = "sglang", then: tuple[str, Callable[[Context], dict]] | None = None) -> dict:
    """Run ``checks`` on their own :func:`deployment`; ``engine="mock"``: the harness's dry run on emulated
    engines (``model_config`` the model directory, no bundle, no reference server,
    :data:`~prfaas_sglang.gpu.e2e.MOCK_CHECKS` only); ``engine="sglang-cpu"``: real SGLang on CPU from this
    environment (no bundle; ``model_config``, else a tiny Llama made here; :data:`~prfaas_sglang.gpu.e2e.CPU_CHECKS`).
    ``then``: (name, step) run on the same deployment after the checks but before ``failover`` (which kills
    a server), every server restored first; its result goes under the summary's ``name``, a crash as
    ``{"error": ...}``, which fails ``ok``. The summary: :func:`~prfaas_sglang.gpu.e2e.summary`."""
    began, facts, results = time.monotonic(), {}, []
    try:
        with deployment(engine, checks, log, bundle_dir=bundle_dir, model_config=model_config, facts=facts) as ctx:
            results = run_checks(ctx, [c for c in checks if c != "failover"])
            if then is not None:
                facts[then[0]] = run_step(ctx, *then)
            results += run_checks(ctx, [c for c in checks if c == "failover"])
    except DeploymentFailed as err:  # start-up failed: every requested check fails with the cause
        results = [CheckResult(name, False, f"deployment did not start: {err}") for name in checks]
        for result in results:
            log(result.line())
    facts["total_s"] = round(time.monotonic() - began, 1)
    if not results and then is None:  # nothing asked: no logs worth keeping
        shutil.rmtree(facts["work_dir"], ignore_errors=True)
    result = summary(results, facts)
    if then is not None and (then[0] not in facts or "error" in facts[then[0]]):
        result["ok"] = False
    return result


def run_step(ctx: Context, name: str, step: Callable[[Context], dict]) -> dict:
    """``step(ctx)`` after :func:`restore`, timed; a crash is ``{"error": ...}`` (logged), not the run's end."""
    started = time.monotonic()
    try:
        restore(ctx)
        result = step(ctx)
    except Exception as err:  # noqa: BLE001 - the failover check still runs after it
        result = {"error": f"{type(err).__name__}: {err}"}
        ctx.log(f"FAIL {name}: {result['error']}")
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


__all__ = ["ADMIN_TOKEN", "CHECK_FUNCTIONS", "Context", "DeploymentFailed", "deployment", "ensure_reference", "preflight",
           "restore", "run", "run_checks", "run_order", "run_step"]
