"""The router's admin API (``/admin/*``), behind ``Authorization: Bearer $PRFAAS_ADMIN_TOKEN``.

    POST   /admin/threshold          {"threshold_tokens": N | null, "link"?: "prfaas->pd"}
                                          override t / back to the baseline, on one link or (no link) every one;
                                          answers each link's t (and, when that is one link, its t as threshold_tokens)
    POST   /admin/workers/{name}/drain    {"draining": true | false}  stop / resume routing to a worker
    POST   /admin/workers/{name}/role     {"new_role": "prefill" | "decode", "drain_timeout_s"?: 300}
                                          drain, switch, follow (router/conversion.py); 200 with what happened,
                                          404/409 refused, 504 not drained in time, 502 the switch failed
    POST   /admin/workers            {name, url, cluster, role, bootstrap_port?, kv_events_port?, telemetry_port?,
                                      switch_url?}  (cluster: a cluster of the topology, or its kind, prfaas | pd,
                                      where the deployment has one of that kind; switch_url: where
                                      /pd_role_switch is served, PD workers only)
    DELETE /admin/workers/{name}

Without a configured token the API answers 403; a missing or wrong token, 401.
Every error is JSON with a one-line message; nothing changes on an error.
"""

from __future__ import annotations

import ipaddress
import json
import math
import time
from urllib.parse import urlparse

import orjson
from aiohttp import web

from prfaas_sglang.envs import envs
from prfaas_sglang.router.workers import WorkerRecord
from prfaas_sglang.wire.auth import AuthError, check_bearer


def _err(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _authorized(request: web.Request) -> web.Response | None:
    token = envs.ADMIN_TOKEN.get()
    if not token:
        return _err(403, "admin API disabled: set PRFAAS_ADMIN_TOKEN for the router")
    try:
        check_bearer(token, request.headers.get("Authorization"))  # constant time, as every bearer check of ours
    except AuthError:
        return _err(401, "missing or wrong bearer token")
    return None


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": {"message": message, "code": 400}}), content_type="application/json")


async def _body(request: web.Request) -> dict:
    """The JSON object of the request, parsed strictly (orjson: no NaN or Infinity, nesting bounded,
    valid UTF-8 whatever the declared charset); a 400 otherwise."""
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise _bad_request(f"body is not valid JSON ({err})") from None
    if not isinstance(body, dict):
        raise _bad_request("body must be an object")
    return body


def _worker_url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a worker (None: it can): http://host:port with a port in 1..65535,
    and not a link-local address (cloud metadata services live there)."""
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError as err:
        return f"url {url!r} does not parse: {err}"
    if parsed.scheme != "http" or not parsed.hostname or not port:
        return f"url must look like http://host:port, got {url!r}"
    try:
        address = ipaddress.ip_address(parsed.hostname)
    except ValueError:
        address = None
    if (address is not None and address.is_link_local) or parsed.hostname.lower() == "metadata.google.internal":
        return f"url {url!r} is link-local (a cloud metadata address); a worker cannot live there"
    return None


def _site_of(sites: dict[str, str], cluster: str) -> tuple[str | None, str | None]:
    """(the cluster a registration names, or None; why not): a cluster of the deployment by name, or its
    kind where the deployment has exactly one cluster of that kind."""
    if cluster in sites:
        return cluster, None
    of_kind = [name for name, kind in sites.items() if kind == cluster]
    if len(of_kind) == 1:
        return of_kind[0], None
    if of_kind:
        return None, f"cluster {cluster!r} is a kind with several clusters here; name one of {', '.join(of_kind)}"
    return None, f"cluster must be one of {', '.join(sites)} (or its kind, prfaas | pd, where there is one), got {cluster!r}"


def add_admin_routes(app: web.Application, service_key, on_register, on_deregister, on_convert=None) -> None:
    """``on_register(app, record)`` / ``on_deregister(app, name)`` start/stop what follows a worker;
    ``on_convert(app, name, new_role, drain_timeout_s)`` runs one conversion (a ``Conversion``, or
    raises ``ConversionError``)."""

    async def threshold(request):
        if (denied := _authorized(request)) is not None:
            return denied
        body = await _body(request)
        value = body.get("threshold_tokens", "missing")
        if value == "missing" or (value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                         or not math.isfinite(value) or value <= 0)):
            return _err(400, "threshold_tokens must be a positive, finite number or null")
        service = request.app[service_key]
        link = body.get("link")
        links = {str(pair): ps for pair, ps in service.pairs.items()}
        if link is not None and (not isinstance(link, str) or link not in links):
            return _err(400, f"link must be one of {', '.join(links)} (or absent: every link), got {link!r}")
        chosen = [links[link]] if link is not None else list(links.values())
        now = {str(ps.pair): ps.controller.override(time.monotonic(), value) for ps in chosen}
        one = {"threshold_tokens": next(iter(now.values()))} if len(now) == 1 else {}  # one link: its t
        return web.json_response({**one, "override": value is not None, "links": now})

    async def drain(request):
        if (denied := _authorized(request)) is not None:
            return denied
        service = request.app[service_key]
        worker = service.workers.get(request.match_info["name"])
        if worker is None:
            return _err(404, f"unknown worker {request.match_info['name']!r}")
        body = await _body(request)
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            return _err(400, "draining must be true or false")
        worker.draining = draining
        return web.json_response({"worker": worker.name, "draining": worker.draining})

    async def register(request):
        if (denied := _authorized(request)) is not None:
            return denied
        service = request.app[service_key]
        body = await _body(request)
        missing = [k for k in ("name", "url", "cluster", "role") if k not in body]
        if missing:
            return _err(400, f"missing field {missing[0]!r} (need name, url, cluster, role)")
        if bad := [k for k in ("name", "url", "cluster", "role") if not isinstance(body[k], str) or not body[k]]:
            return _err(400, f"{bad[0]} must be a non-empty string, got {body[bad[0]]!r}")
        name, url, cluster, role = (body[k] for k in ("name", "url", "cluster", "role"))
        if (problem := _worker_url_problem(url)) is not None:
            return _err(400, problem)
        parsed = urlparse(url)
        site, problem = _site_of(service.site_kinds(), cluster)
        if problem is not None:
            return _err(400, problem)
        cluster = service.site_kinds()[site]
        if role not in ("prefill", "decode") or (cluster == "prfaas" and role == "decode"):
            return _err(400, "role must be prefill or decode (decode lives in a pd cluster)")
        ports = {}
        for key in ("bootstrap_port", "kv_events_port", "telemetry_port"):
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535):
                return _err(400, f"{key} must be a port number")
            ports[key] = value
        if role == "prefill" and ports["bootstrap_port"] is None:
            return _err(400, "a prefill worker needs bootstrap_port")
        switch_url = body.get("switch_url")
        if switch_url is not None:  # the worker itself (in-place) or its launcher's supervisor (restart)
            if cluster != "pd":
                return _err(400, "only PD-cluster workers switch roles: switch_url is for cluster pd")
            if (problem := _worker_url_problem(str(switch_url))) is not None:
                return _err(400, f"switch_url: {problem}")
            if ports["bootstrap_port"] is None:
                return _err(400, "a switchable worker needs bootstrap_port (it serves it while it is prefill)")
            switch_url = str(switch_url).rstrip("/")
        if name in service.workers:
            return _err(409, f"worker {name!r} is already registered")
        host = parsed.hostname
        record = WorkerRecord(name, url.rstrip("/"), cluster, role, host, ports["bootstrap_port"],
                              f"tcp://{host}:{ports['kv_events_port']}" if ports["kv_events_port"] else None,
                              f"tcp://{host}:{ports['telemetry_port']}" if ports["telemetry_port"] else None,
                              switch_url, site=site)
        service.workers[name] = record
        on_register(request.app, record)
        return web.json_response({"registered": name}, status=201)

    async def deregister(request):
        if (denied := _authorized(request)) is not None:
            return denied
        service = request.app[service_key]
        name = request.match_info["name"]
        if name not in service.workers:
            return _err(404, f"unknown worker {name!r}")
        remaining = [w for w in service.workers.values() if w.name != name]
        if not any(w.role == "decode" for w in remaining) or not any(w.role == "prefill" for w in remaining):
            return _err(409, f"deregistering {name!r} would leave no prefill or no decode worker; drain it instead")
        del service.workers[name]
        on_deregister(request.app, name)
        return web.json_response({"deregistered": name})

    async def role(request):
        if (denied := _authorized(request)) is not None:
            return denied
        from prfaas_sglang.router.conversion import ConversionError

        body = await _body(request)
        new_role = body.get("new_role")
        if new_role not in ("prefill", "decode"):
            return _err(400, "new_role must be prefill or decode")
        timeout_s = body.get("drain_timeout_s", 300.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86_400:
            return _err(400, "drain_timeout_s must be a number of seconds in (0, 86400]")
        if on_convert is None:
            return _err(501, "this router does not convert workers")
        try:
            done = await on_convert(request.app, request.match_info["name"], new_role, float(timeout_s))
        except ConversionError as err:
            return _err(err.status, err.message)
        return web.json_response(done.to_json())

    app.router.add_post("/admin/threshold", threshold)
    app.router.add_post("/admin/workers/{name}/role", role)
    app.router.add_post("/admin/workers/{name}/drain", drain)
    app.router.add_post("/admin/workers", register)
    app.router.add_delete("/admin/workers/{name}", deregister)
