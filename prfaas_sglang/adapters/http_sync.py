"""The package's one synchronous HTTP client (I/O), on ``requests``.

Async code (our servers, the load generators) uses aiohttp. Everything that blocks goes through
here: the process harness's readiness poll, the benchmarks' drivers, the CLI preflights, the hooks
inside SGLang's processes, the tests. One place says what a timeout, a refused connection and an
unwanted answer are.

* :func:`request`, :func:`get`, :func:`post`: any answer, as a :class:`Response`; they raise
  :class:`HttpError` (``status`` None) only when there is no answer.
* :func:`get_json`, :func:`post_json`, :func:`get_text`: the body of a 2xx answer; another status,
  or a body that is not JSON, raises :class:`HttpError` (with the status).
* :func:`stream`: an answer read as it arrives (server-sent events, a time to first token).
* :class:`Client`: the same calls over kept-alive connections, for a loop of requests to the same
  servers (thread-safe).

``timeout_s`` is requests' timeout: it bounds the connect and then each wait for data, not the whole
exchange. A redirect is an answer like any other (not followed). Proxies, CA bundles and the like
come from the environment, as requests reads them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import requests
import requests.adapters
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError, NewConnectionError

from prfaas_sglang.errors import PrfaasError

ERROR_BODY_CHARS = 200  # how much of an unwanted answer's body an error message quotes
STREAM_READ_BYTES = 1 << 16  # the most one read of a streamed body returns (it returns what has arrived)


class HttpError(PrfaasError, OSError):
    """An exchange that did not give what was asked (an :class:`OSError`, like urllib's errors).

    ``status``: the answer's status; None when there was no answer (refused, reset, unresolvable,
    timed out). ``connected``: False only when no connection was made (refused, unresolvable, the
    connect timed out): the request then provably never reached the server. ``body``: the
    answer's body (empty without one)."""

    def __init__(self, method: str, url: str, problem: str, *, status: int | None = None,
                 connected: bool = True, body: bytes = b""):
        self.method, self.url, self.status, self.connected, self.body = method, url, status, connected, body
        super().__init__(f"{method} {url}: {problem}")


@dataclass(frozen=True)
class Response:
    """A whole answer. ``headers`` looks names up in any case (``headers.get("x-prfaas-route")``)."""

    method: str
    url: str
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; :class:`HttpError` (with the status) when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise HttpError(self.method, self.url, f"HTTP {self.status}, body not JSON ({err})", status=self.status,
                            body=self.body) from None

    def raise_for_status(self) -> Response:
        """This answer when its status is 2xx; else :class:`HttpError` quoting the body's start."""
        if not self.ok:
            raise HttpError(self.method, self.url, f"HTTP {self.status}: {self.text[:ERROR_BODY_CHARS]}",
                            status=self.status, body=self.body)
        return self


class StreamedResponse:
    """An answer whose body is read as it arrives (:func:`stream`); ``status`` and ``headers`` as in
    :class:`Response`. A broken connection while reading raises :class:`HttpError`."""

    def __init__(self, method: str, url: str, resp: requests.Response):
        self.method, self.url, self._resp = method, url, resp
        self.status: int = resp.status_code
        self.headers: Mapping[str, str] = resp.headers

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def _broke(self, err: Exception) -> HttpError:
        return HttpError(self.method, self.url, f"the answer broke off: {type(err).__name__}: {err}", status=self.status)

    def lines(self) -> Iterator[bytes]:
        """The body's lines as they arrive, line endings removed."""
        # requests' iter_lines/iter_content wait for a whole chunk_size of a body that is not
        # chunk-encoded; urllib3's read1 returns what has arrived, chunk-encoded or not.
        parts: list[bytes] = []  # the line being read, in pieces
        while True:
            try:
                piece = self._resp.raw.read1(STREAM_READ_BYTES, decode_content=True)
            except (OSError, Urllib3Error) as err:
                raise self._broke(err) from None
            if not piece:
                break
            *complete, rest = piece.split(b"\n")
            for line in complete:
                yield (b"".join(parts) + line if parts else line).rstrip(b"\r")
                parts = []
            if rest:
                parts.append(rest)
        if parts:
            yield b"".join(parts).rstrip(b"\r")

    def read(self) -> bytes:
        """The rest of the body."""
        try:
            return self._resp.raw.read(decode_content=True)
        except (OSError, Urllib3Error) as err:
            raise self._broke(err) from None

    def raise_for_status(self) -> StreamedResponse:
        """This answer when its status is 2xx; else :class:`HttpError` quoting the body's start (read whole)."""
        if not self.ok:
            body = self.read()
            raise HttpError(self.method, self.url, f"HTTP {self.status}: {body[:ERROR_BODY_CHARS].decode(errors='replace')}",
                            status=self.status, body=body)
        return self


# --- one exchange -------------------------------------------------------------------------------


def _encode(json_body: Any, data: bytes | str | None, headers: Mapping[str, str] | None) -> tuple[bytes | None, dict]:
    out = dict(headers or {})
    if json_body is not None:
        if data is not None:
            raise ValueError("give json_body or data, not both")
        if not any(name.lower() == "content-type" for name in out):
            out["Content-Type"] = "application/json"
        return json.dumps(json_body).encode(), out
    return (data.encode() if isinstance(data, str) else data), out


def _cause(err: requests.RequestException) -> BaseException:
    """What urllib3 said under requests' ``err`` (a MaxRetryError's reason, unwrapped)."""
    cause = err.args[0] if err.args and isinstance(err.args[0], BaseException) else err
    return cause.reason if isinstance(cause, MaxRetryError) and cause.reason is not None else cause


def _connected(err: requests.RequestException) -> bool:
    """False when ``err`` says no connection was made: the connect timed out, or it failed
    (refused, unreachable, unresolvable: urllib3's NewConnectionError, its NameResolutionError included)."""
    return not isinstance(err, requests.ConnectTimeout) and not isinstance(_cause(err), NewConnectionError)


def _send(session: requests.Session, method: str, url: str, body: bytes | None, headers: dict,
          timeout_s: float) -> requests.Response:
    """The answer's head (its body unread, the connection held until it is read or closed)."""
    try:
        return session.request(method, url, data=body, headers=headers, timeout=timeout_s, stream=True,
                               allow_redirects=False)
    except (requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL) as err:
        raise HttpError(method, url, f"not an http(s) URL ({err})", connected=False) from None
    except (requests.ConnectionError, requests.Timeout) as err:
        connected, cause = _connected(err), _cause(err)
        raise HttpError(method, url, f"{'no answer' if connected else 'no connection'}: {type(cause).__name__}: {cause}",
                        connected=connected) from None


def _read(method: str, url: str, resp: requests.Response) -> Response:
    try:
        body = resp.content
    except OSError as err:  # requests' errors are OSErrors
        raise HttpError(method, url, f"the answer broke off: {type(err).__name__}: {err}", status=resp.status_code) from None
    finally:
        resp.close()  # a connection whose answer was read whole goes back to its pool; another is closed
    return Response(method, url, resp.status_code, resp.headers, body)


def request(method: str, url: str, *, timeout_s: float, json_body: Any = None, data: bytes | str | None = None,
            headers: Mapping[str, str] | None = None) -> Response:
    """One exchange on a connection of its own: the answer, whatever its status. ``json_body`` is sent
    as JSON (``Content-Type: application/json`` unless ``headers`` say otherwise), ``data`` as is.
    Raises :class:`HttpError` (``status`` None) when no answer came."""
    body, sent_headers = _encode(json_body, data, headers)
    with requests.Session() as session:
        return _read(method, url, _send(session, method, url, body, sent_headers, timeout_s))


def get(url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Response:
    """``GET url``: :func:`request`."""
    return request("GET", url, timeout_s=timeout_s, headers=headers)


def post(url: str, *, timeout_s: float, json_body: Any = None, data: bytes | str | None = None,
         headers: Mapping[str, str] | None = None) -> Response:
    """``POST url``: :func:`request`."""
    return request("POST", url, timeout_s=timeout_s, json_body=json_body, data=data, headers=headers)


def get_json(url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Any:
    """The JSON body of a 2xx answer to ``GET url``; :class:`HttpError` otherwise."""
    return get(url, timeout_s=timeout_s, headers=headers).raise_for_status().json()


def post_json(url: str, body: Any, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Any:
    """The JSON body of a 2xx answer to ``POST url`` with ``body`` as JSON; :class:`HttpError` otherwise."""
    return post(url, timeout_s=timeout_s, json_body=body, headers=headers).raise_for_status().json()


def get_text(url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> str:
    """The body of a 2xx answer to ``GET url`` as text (``/metrics``); :class:`HttpError` otherwise."""
    return get(url, timeout_s=timeout_s, headers=headers).raise_for_status().text


@contextlib.contextmanager
def stream(method: str, url: str, *, timeout_s: float, json_body: Any = None, data: bytes | str | None = None,
           headers: Mapping[str, str] | None = None) -> Iterator[StreamedResponse]:
    """``with stream(...) as answer``: the answer once its head arrived, its body read as it comes
    (:meth:`StreamedResponse.lines`); the connection is closed on leaving. Whatever the status;
    :class:`HttpError` when no answer came."""
    body, sent_headers = _encode(json_body, data, headers)
    with requests.Session() as session:
        resp = _send(session, method, url, body, sent_headers, timeout_s)
        try:
            yield StreamedResponse(method, url, resp)
        finally:
            resp.close()


# --- kept-alive connections -------------------------------------------------------------------------


class Client:
    """:func:`request`, :func:`get_json` and :func:`post_json` over kept-alive connections.

    One connection pool (a requests ``HTTPAdapter``: urllib3's, thread-safe) serves every thread,
    each through a ``requests.Session`` of its own (a Session is not documented as thread-safe). A
    connection goes back to the pool once its answer was read whole and the server keeps it open; an
    idle one the server closed meanwhile is replaced, not used. ``headers`` go with every request
    (a call's own take precedence). :meth:`close` closes the idle connections; the client can still
    be used afterwards (it connects again)."""

    def __init__(self, headers: Mapping[str, str] | None = None):
        self.headers = dict(headers or {})
        self._adapter = requests.adapters.HTTPAdapter()
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.mount("http://", self._adapter)
            session.mount("https://", self._adapter)
            self._local.session = session
        return session

    def request(self, method: str, url: str, *, timeout_s: float, json_body: Any = None,
                data: bytes | str | None = None, headers: Mapping[str, str] | None = None) -> Response:
        """As :func:`request`. A failure on a reused connection is an answer that did not come
        (``connected`` True: the request may have reached the server)."""
        body, sent_headers = _encode(json_body, data, {**self.headers, **(headers or {})})
        return _read(method, url, _send(self._session(), method, url, body, sent_headers, timeout_s))

    def get_json(self, url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Any:
        """As :func:`get_json`."""
        return self.request("GET", url, timeout_s=timeout_s, headers=headers).raise_for_status().json()

    def post_json(self, url: str, body: Any, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Any:
        """As :func:`post_json`."""
        return self.request("POST", url, timeout_s=timeout_s, json_body=body, headers=headers).raise_for_status().json()

    def close(self) -> None:
        self._adapter.close()
