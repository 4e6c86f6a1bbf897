"""The router's OpenAPI 3.0 description, served at ``GET /openapi.json`` (pure).

It describes what the router accepts, so standard API fuzzers (schemathesis) and clients can
run against it: the data plane (SGLang's ``/generate`` and the OpenAI-compatible completions
and chat endpoints, the fields the router reads or forwards), the read-only endpoints, and
the admin API. Fields the router passes on untouched are allowed (``additionalProperties``);
every documented error is a JSON ``{"error": {"message", "code", "type"?}}``.
"""

from __future__ import annotations

from prfaas_sglang.protocol import MAX_TOKEN_ID

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "code"],
    "properties": {"message": {"type": "string"}, "code": {"type": "integer"}, "type": {"type": "string"}}}}}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
        "description": "prompt token ids (within the model's vocabulary)"}
_SAMPLING = {"type": "object", "additionalProperties": True, "properties": {
    "max_new_tokens": {"type": "integer", "minimum": 0}, "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "ignore_eos": {"type": "boolean"}}}
_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type"], "additionalProperties": True,
    "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    why = {400: "malformed request", 401: "missing or wrong bearer token", 403: "admin API disabled",
           404: "unknown worker", 409: "conflict", 413: "body too large", 429: "too many waiting requests",
           502: "a worker leg failed", 503: "no worker can take it now (Retry-After)", 504: "a worker leg timed out"}
    return {str(c): {"description": why[c], **_json({"$ref": "#/components/schemas/Error"})} for c in codes}


def _data_plane(summary: str, body: dict) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, **_json(body)},
                     "responses": {"200": {"description": "the completion (JSON, or text/event-stream with stream)"},
                                   **_errors(400, 413, 429, 502, 503, 504)}}}


def _admin(method: str, summary: str, body: dict | None = None, named: bool = False, extra_errors: tuple[int, ...] = ()) -> dict:
    op: dict = {"summary": summary, "security": [{"bearer": []}],
                "responses": {"200": {"description": "done", **_json({"type": "object"})},
                              **_errors(400, 401, 403, *((404,) if named else ()), *((409,) if method == "post" and not named else ()),
                                        *extra_errors)}}
    if body is not None:
        op["requestBody"] = {"required": True, **_json(body)}
    if named:
        op["parameters"] = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]
    return {method: op}


def router_openapi(version: str, models: list[str] | None = None) -> dict:
    """The description for router ``version``; ``models``: the names it serves now (an enum for
    ``model``; None: any string)."""
    model = {"type": "string", **({"enum": list(models)} if models else {})}
    generate = {"type": "object", "additionalProperties": True, "properties": {
        "text": {"type": "string"}, "input_ids": _IDS, "sampling_params": _SAMPLING,
        "stream": {"type": "boolean"}, "rid": {"type": "string", "pattern": "^[!-~]{1,256}$"}, "model": model}}
    completions = {"type": "object", "required": ["prompt"], "additionalProperties": True, "properties": {
        "model": model, "prompt": {"oneOf": [{"type": "string"}, _IDS]},
        "max_tokens": {"type": "integer", "minimum": 0}, "temperature": {"type": "number", "minimum": 0},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"},
                                                             "continuous_usage_stats": {"type": "boolean"}}}}}
    chat = {"type": "object", "required": ["messages"], "additionalProperties": True, "properties": {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": True,
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]}, "content": _CONTENT}}},
        "max_tokens": {"type": "integer", "minimum": 0}, "max_completion_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0}, "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"},
                                                             "continuous_usage_stats": {"type": "boolean"}}}}}
    worker = {"type": "object", "required": ["name", "url", "cluster", "role"], "properties": {
        "name": {"type": "string", "minLength": 1}, "url": {"type": "string", "format": "uri"},
        "cluster": {"type": "string", "minLength": 1, "description": "a cluster of the topology, or its kind (prfaas | pd) "
                    "where the deployment has one of that kind"},
        "role": {"type": "string", "enum": ["prefill", "decode"]},
        "bootstrap_port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "kv_events_port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "telemetry_port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "switch_url": {"type": "string", "format": "uri"}}}
    text = {"200": {"description": "ok", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "prfaas-sglang router", "version": version,
                 "description": "Global scheduler in front of a PrfaaS cluster and a local PD cluster."},
        "paths": {
            "/generate": _data_plane("SGLang's native generate (text or input_ids)", generate),
            "/v1/completions": _data_plane("OpenAI completions", completions),
            "/v1/chat/completions": _data_plane("OpenAI chat completions", chat),
            "/health": {"get": {"summary": "liveness", "responses": text}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": text}},
            "/v1/models": {"get": {"summary": "served models", "responses": {"200": {"description": "ok", **_json({"type": "object"})}}}},
            "/status": {"get": {"summary": "routing state: threshold, link, workers, recent decisions",
                                "responses": {"200": {"description": "ok", **_json({"type": "object"})}}}},
            "/openapi.json": {"get": {"summary": "this description", "responses": {"200": {"description": "ok", **_json({"type": "object"})}}}},
            "/admin/threshold": _admin("post", "override t (null: back to the baseline)", {
                "type": "object", "required": ["threshold_tokens"],
                "properties": {"threshold_tokens": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0},
                               "link": {"type": "string", "description": "one link (prfaas->pd); absent: every link"}}}),
            "/admin/workers": _admin("post", "register a worker", worker),
            "/admin/workers/{name}": _admin("delete", "deregister a worker", named=True),
            "/admin/workers/{name}/drain": _admin("post", "stop or resume routing to a worker", {
                "type": "object", "required": ["draining"], "properties": {"draining": {"type": "boolean"}}}, named=True),
            "/admin/workers/{name}/role": _admin("post", "drain a PD worker, switch it to the other role, follow", {
                "type": "object", "required": ["new_role"], "properties": {
                    "new_role": {"type": "string", "enum": ["prefill", "decode"]},
                    "drain_timeout_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 86400}}},
                named=True, extra_errors=(409, 502, 504)),
        },
        "components": {"schemas": {"Error": _ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
