"""The HTTP API of SPEC §4 on aiohttp: JSON under /v1, one error shape, the caller from the kernel."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import sys
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from aiohttp import HttpVersion11, web, web_protocol, web_urldispatcher
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gpubroker.broker import holders
from gpubroker.broker.lease import ENDED, LIVE, Lease
from gpubroker.broker.request import MAX_PID, parse_request
from gpubroker.broker.service import API_TOKEN, OWN_USER_ON_SOCKET, ROOT_ON_SOCKET, WEB_UI, Broker, Caller, socket_admin
from gpubroker.config import Config
from gpubroker.errors import BrokerError, FailureCode, Forbidden, InvalidRequest, NotFound, Refusal, Unauthorized
from gpubroker.ui.auth import CHANGES, CSRF_FIELD, CSRF_HEADER, OPEN_PATHS, SESSION_COOKIE, Guard, Session, Sessions, is_loopback
from gpubroker.ui.metrics import Metrics
from gpubroker.ui.openapi import OPENAPI, QUERY_PARAMETERS
from gpubroker.units import UnitError, parse_duration, printable_text

if TYPE_CHECKING:
    from gpubroker.gossip.mesh import Mesh

BROKER = web.AppKey("broker", Broker)
CALLER = web.RequestKey("caller", Caller)
CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
CONFIG_HOSTS = web.AppKey("allowed_hosts", frozenset)
GUARD = web.AppKey("guard", Guard)
SESSION = web.RequestKey("session", Session)
CONTINUED = web.RequestKey("continued", bool)  # 100 Continue was sent: the caller sends its body


@dataclass(slots=True)
class MeshSlot:
    """The mesh, once there is one: a node that asks to join gets it after an operator approves, while serving."""

    mesh: Mesh | None = None


MESH: web.AppKey[MeshSlot] = web.AppKey("mesh")
STATES = ("queued", LIVE, *ENDED)
# Refusals a peer may not have: no room here now, or no GPU here large enough (or enough GPUs) at all.
ROOM_CODES = (
    FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM,
    FailureCode.EXTERNAL_GPU_PRESSURE,
    FailureCode.LEASE_CONFLICT,
    FailureCode.CAPABILITY_UNAVAILABLE,
)
_PEERCRED = struct.Struct("3i")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


def _error(error: BrokerError) -> web.Response:
    return web.json_response(error.to_json(), status=error.status)


def answer_unreadable_requests_in_one_shape() -> None:
    """A request the HTTP parser cannot read (a byte no URL may hold, a broken request line) never reaches the
    app or its middleware: aiohttp answers it itself. That answer, too, is given the one error shape of SPEC
    §3.6, with the status aiohttp chose; a handler's crash stays aiohttp's 500. Idempotent."""
    original = web_protocol.RequestHandler.handle_error
    if getattr(original, "in_one_shape", False):
        return

    def handle_error(
        self: web_protocol.RequestHandler,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        answer = original(self, request, status, exc, message)  # it logs the request, and refuses once an answer has begun
        if not 400 <= status < 500:
            return answer
        if isinstance(exc, ContentEncodingError):  # a coding aiohttp knows but cannot decode here (br, zstd)
            error = _unread_coding("the body's Content-Encoding")
        else:
            what = unreadable_detail(exc) if exc is not None else (message or "")
            error = InvalidRequest(f"the request cannot be read as HTTP: {what or 'malformed'}", {"status": status}, status=status)
        shaped = _error(error)
        shaped.force_close()  # as aiohttp's own: what follows on this connection cannot be trusted
        return shaped

    handle_error.in_one_shape = True  # type: ignore[attr-defined]
    web_protocol.RequestHandler.handle_error = handle_error  # type: ignore[method-assign]


async def _expect_later(request: web.BaseRequest) -> None:
    """In place of aiohttp's Expect handler, which runs before any middleware and so told a caller without the token,
    or from a foreign Host, to send its body: the middleware judges the expectation after its checks, and the body is
    asked for (100 Continue) when a handler reads it."""


def meet_expectations_after_checks() -> None:
    """Idempotent; every route and aiohttp's own 404s and 405s take their Expect handler from this name."""
    web_urldispatcher._default_expect_handler = _expect_later


def _check_query(request: web.Request) -> None:
    """On the API's paths, only the query parameters the OpenAPI document gives the operation, each once: a typo
    (`?stat=granted`) or a second value (`?state=granted&state=ended`) would otherwise be read as no filter, or as
    the first value alone. The pages and /metrics take what they like (a login's `next`, a browser's own)."""
    if not request.query or not request.path.startswith("/v1/"):
        return
    resource = request.match_info.route.resource
    if resource is None:  # no such path, or not with this method: answered as that
        return
    method = "GET" if request.method == "HEAD" else request.method
    operation = f"{request.method} {resource.canonical}"
    allowed = QUERY_PARAMETERS.get((method, resource.canonical), ())
    takes = f"it takes: {', '.join(allowed)}" if allowed else "it takes none"
    for name in request.query:
        if name not in allowed:
            raise InvalidRequest(
                f"unknown query parameter {_text(name)!r} for {operation}; {takes}", {"field": name, "allowed": list(allowed)}
            )
        if len(given := request.query.getall(name)) > 1:
            raise InvalidRequest(
                f"query parameter {_text(name)!r} given {len(given)} times for {operation}; give it once", {"field": name, "values": given}
            )


READ_CODINGS = ("identity", "gzip", "deflate")  # the Content-Encodings a body may come in (aiohttp decodes the last two)


def _check_encoding(request: web.Request) -> None:
    """A body in a coding the broker does not read is refused: aiohttp reads one it does not know (`foo`, `gzip, gzip`)
    as plain, and answers br and zstd, without their libraries, with a hint to install them meant for the server's owner."""
    codings = request.headers.getall("Content-Encoding", ())
    if codings and (len(codings) > 1 or codings[0].strip().lower() not in READ_CODINGS):
        raise _unread_coding(f"Content-Encoding {_text(', '.join(codings))!r}")


def _unread_coding(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what} is not one this broker reads: send the body plain, or as gzip or deflate", {"read": list(READ_CODINGS)}, status=415
    )


def _check_expectation(request: web.Request) -> None:
    expect = request.headers.get("Expect")
    if expect is not None and request.version == HttpVersion11 and expect.strip().lower() != "100-continue":
        raise InvalidRequest(
            f"Expect: {_text(expect)!r} is not an expectation this broker meets; only 100-continue", {"expect": expect}, status=417
        )


def _awaits_continue(request: web.Request) -> bool:
    """Whether the caller holds its body back until it is asked for it (Expect: 100-continue) and has not been yet."""
    expect = request.headers.get("Expect", "")
    return request.version == HttpVersion11 and expect.strip().lower() == "100-continue" and not request.get(CONTINUED)


async def _continue(request: web.Request) -> None:
    """Ask for the body of a caller that waits to be asked, once, as it is read."""
    if _awaits_continue(request):
        request[CONTINUED] = True
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not begun


def unreadable_detail(error: BaseException) -> str:
    """What aiohttp says of a request it cannot read, fit for a message: the first line of its message (the
    next ones quote the bytes and point at them), of the error it wraps if any, cut to MAX_KEPT characters."""
    cause = error.__cause__ if isinstance(error, RequestPayloadError) and error.__cause__ is not None else error
    said = getattr(cause, "message", None)
    lines = [line for line in (said if isinstance(said, str) and said.strip() else str(cause)).splitlines() if line.strip()]
    return str(_text(lines[0].strip().rstrip(":") if lines else type(cause).__name__))


async def read_form(request: web.Request) -> Any:
    """A form's fields, or INVALID_REQUEST when the body cannot be read as one (an unknown charset, bytes
    that are not its text, a multipart body without its boundary) or is not whole within IDLE_TIMEOUT."""
    try:
        await _continue(request)
        return await _whole(request.post())
    except (ValueError, LookupError, AssertionError, HttpProcessingError) as error:
        raise InvalidRequest(f"the form cannot be read: {_text(str(error) or type(error).__name__)}") from None


PAGE_PREFIXES = ("/v1/", "/fragment/", "/metrics", "/openapi.json", "/healthz")


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host, Origin and sign-in checks, then the handler; every failure leaves in the one error shape, with its status from SPEC §3.6."""
    try:
        if _caller(request).transport == "tcp":  # on the Unix socket the kernel has named the caller: nothing to check
            _check_host(request)
            _check_origin(request)
            await _authenticate(request)
        _check_expectation(request)
        _check_encoding(request)
        _check_query(request)
        return await handler(request)
    except Unauthorized as error:
        if request.method == "GET" and not request.path.startswith(PAGE_PREFIXES):
            from gpubroker.ui import pages

            return pages.login_page(request, status=401)  # a person at a page gets the form to sign in
        if request.method == "POST" and request.path == "/logout":  # its session had ended already: signed out, as asked
            answer = web.Response(status=303, headers={"Location": "/login"})
            answer.del_cookie(SESSION_COOKIE, path="/")
            return answer
        return _refusal(request, error)
    except BrokerError as error:
        return _refusal(request, error)
    except (RequestPayloadError, HttpProcessingError) as error:  # a body that cannot be read: bad compression, say
        answer = _refusal(request, InvalidRequest(f"the request body cannot be read: {unreadable_detail(error)}", {}))
        answer.force_close()  # what is left of the body cannot be skipped: the connection ends with this answer
        return answer
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body
        return _refusal(
            request, InvalidRequest(f"the request body is larger than {limit} bytes (max_body)", {"max_body": limit}, status=413)
        )
    except web.HTTPNotFound:
        return _refusal(request, NotFound(f"no such path: {request.path}", {"path": request.path}))
    except web.HTTPMethodNotAllowed as error:
        allowed = ", ".join(sorted(error.allowed_methods))
        answer = _refusal(
            request,
            InvalidRequest(f"{request.method} is not allowed on {request.path}; allowed: {allowed}", {"path": request.path}, status=405),
        )
        answer.headers["Allow"] = allowed  # as HTTP asks of a 405
        return answer
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _refusal(request, InvalidRequest(f"{error.reason}", {"status": error.status}, status=error.status))


MAX_KEPT = 256  # characters of any one string of a refused caller's kept in its event
# Seconds a connection may go without a whole request: idle between requests, or with its headers (the
# server's keep-alive timer) or its body (the readers below) unfinished. Without it, half-sent requests
# would hold their file descriptors for as long as their clients liked.
IDLE_TIMEOUT = 30.0


def _refusal(request: web.Request, error: BrokerError) -> web.Response:
    """The one error shape; the refusal is kept as an event too (SPEC §3.6), unless the broker kept it already.

    Only the API's and a foreign caller's: a browser's asking for a favicon or a page before signing in
    is not an event.
    """
    if not error.recorded and (request.path.startswith("/v1/") or error.code is FailureCode.FORBIDDEN):
        error.recorded = True
        broker = request.app[BROKER]
        details = broker.refusals.keep(_text({**error.details, "method": request.method, "path": request.path}))
        if details is not None:
            named = details.get("lease")  # a refusal about a lease or a waiting request is found by its `lease`, as theirs are
            broker.record_event(
                "request.refused",
                _text(f"{request.method} {request.path}: {error.message}", 4 * MAX_KEPT),
                code=error.code,
                details=details,
                lease=named if isinstance(named, str) else None,
            )
    answer = _error(error)
    if _awaits_continue(request):
        answer.force_close()  # its body, never asked for, could not be told from a next request on this connection
    return answer


def _text(value: Any, limit: int = MAX_KEPT) -> Any:
    """What a refused caller sent, fit to keep: each string cut to `limit` characters (its event must stay
    small), a lone surrogate (from JSON's escapes or a header's bytes) or a control character written as its escape."""
    if isinstance(value, str):
        return printable_text(value[:limit]) + ("…" if len(value) > limit else "")
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text(v) for v in value]
    return value


def allowed_hosts(config: Config) -> frozenset[str]:
    """localhost, the listen address, this machine's names, and allowed_hosts; on a wildcard address, every local address."""
    host = config.listen.rpartition(":")[0].strip("[]")
    names = {"localhost", "127.0.0.1", "::1", host, *(h.lower() for h in config.allowed_hosts)}
    if not is_loopback(host):
        machine = socket.gethostname().lower()
        names |= {machine, f"{machine}.local"}
    if host in ("0.0.0.0", "::"):
        import psutil

        names |= {
            a.address.split("%")[0]
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
    return frozenset(names)


_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::\d{1,5})?")


def _check_host(request: web.Request) -> None:
    """Against DNS rebinding (a TCP caller): the Host must be localhost, the listen address or an allowed host, and so
    must a target in absolute form (`GET http://HOST/...`), whose host is the request's whatever Host says (RFC 9112
    §3.2.2): answered, a request for another site is served as an open proxy serves it."""
    named = [("Host", request.headers.get("Host", ""))]
    target = request.raw_path
    if not target.startswith("/") and target != "*":  # absolute form (or the authority form of a CONNECT)
        try:
            named.append(("the request's target", urlsplit(target).netloc.rpartition("@")[2] or target))
        except ValueError:  # `http://[::1/`
            named.append(("the request's target", target))
    for where, host in named:
        well_formed = _HOST.fullmatch(host)  # a name or [IPv6 address], then a numeric port if any
        name = (well_formed.group("v6") or well_formed.group("name")) if well_formed else None
        if name is None or name.lower() not in request.app[CONFIG_HOSTS]:
            raise Forbidden(
                f"{where} {host!r} is not this broker's address; add it to allowed_hosts to reach the API by that name", {"host": host}
            )


def _check_origin(request: web.Request) -> None:
    """Against cross-site requests (a TCP caller): a change sent by a page of another site is refused, signed in or not."""
    if request.method not in CHANGES:
        return
    origin = request.headers.get("Origin")
    host = request.headers.get("Host", "")
    try:
        sent_from = urlsplit(origin.lower()) if origin is not None else None
    except ValueError:  # `http://[`: no origin of this broker's
        sent_from = urlsplit("unreadable://")
    if request.headers.get("Sec-Fetch-Site") == "cross-site" or (
        sent_from is not None and (sent_from.scheme, sent_from.netloc) != (request.scheme, host.lower())
    ):
        raise Forbidden(
            f"a change sent from another site ({origin or 'cross-site'}) is refused; use this broker's own pages or the API",
            {"origin": origin, "host": host},
        )


async def _authenticate(request: web.Request) -> None:
    """With a UI password set, a TCP caller needs the API token or a signed-in session (and its CSRF token for a change)."""
    caller = _caller(request)
    guard = request.app[GUARD]
    if not guard.required or request.path.startswith(OPEN_PATHS):
        return
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not guard.token_matches(presented.strip()):
            raise Unauthorized("the API token is not this node's; `gpubroker token` on the node prints it (send it as GPUBROKER_TOKEN)")
        request[CALLER] = replace(caller, admin=API_TOKEN)
        return
    session = guard.sessions.get(request.cookies.get(SESSION_COOKIE))
    if session is None:
        raise Unauthorized(
            "sign in at /login, or send this node's API token as Authorization: Bearer (GPUBROKER_TOKEN; `gpubroker token` prints it)"
        )
    if request.method in CHANGES:
        csrf = request.headers.get(CSRF_HEADER)
        if csrf is None and request.content_type == "application/x-www-form-urlencoded":
            field = (await read_form(request)).get(CSRF_FIELD)
            csrf = field if isinstance(field, str) else None
        if not guard.csrf_matches(session, csrf):
            raise Forbidden(f"a change from the web UI needs its CSRF token ({CSRF_HEADER}); reload the page and try again", {})
    request[CALLER] = replace(caller, admin=WEB_UI, admin_of=request.app[CONFIG].name)
    request[SESSION] = session


_BY_CONNECTION: weakref.WeakKeyDictionary[Any, Caller] = weakref.WeakKeyDictionary()
_TCP = Caller("tcp")


def _caller(request: web.Request) -> Caller:
    """On the Unix socket the kernel names the caller (SO_PEERCRED, read once per connection); on TCP nobody does."""
    if CALLER in request:
        return request[CALLER]
    transport = request.transport
    caller = _BY_CONNECTION.get(transport) if transport is not None else None
    if caller is None:
        sock = transport.get_extra_info("socket") if transport is not None else None
        caller = _TCP
        if sock is not None and sock.family == socket.AF_UNIX:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            caller = Caller("unix", uid=uid, pid=pid or None)
        if transport is not None:
            _BY_CONNECTION[transport] = caller
    request[CALLER] = caller
    return caller


async def _whole(reading: Awaitable[T]) -> T:
    """A body read within IDLE_TIMEOUT: one that stops short is refused (the middleware answers it and ends
    its connection)."""
    try:
        async with asyncio.timeout(IDLE_TIMEOUT):
            return await reading
    except TimeoutError:
        raise RequestPayloadError(f"it did not all arrive within {IDLE_TIMEOUT:g}s") from None


async def _body(request: web.Request) -> bytes:
    await _continue(request)
    if request.content.is_eof():  # all of it has arrived (as a lease request's has, with its headers): no timer to set
        return await request.read()
    return await _whole(request.read())


async def _json_body(request: web.Request, *, optional: bool = False) -> Any:
    raw = await _body(request)
    if not raw.strip() and optional:
        return {}
    return decode_json(raw)


def decode_json(raw: bytes) -> Any:
    """What json.loads does with bytes (UTF-8, or UTF-16 or UTF-32 as their first bytes show), with one decoder made once
    (json.loads makes one per call when given options); text that is not in its encoding, or an object that gives a key
    twice, is INVALID_REQUEST saying so."""
    encoding = json.detect_encoding(raw)
    try:
        text = raw.decode(encoding, "surrogatepass")
    except UnicodeDecodeError as error:
        name = "UTF-8" if encoding.startswith("utf-8") else encoding.upper()
        bad = raw[error.start : error.end].hex(" ")
        raise InvalidRequest(
            f"the body is not {name} text, as JSON must be: {error.reason} ({bad}) at byte offset {error.start}",
            {"offset": error.start},
        ) from None
    try:
        return _DECODER.decode(text)
    except _DuplicateKey as error:
        key = error.key[:MAX_KEPT]
        raise InvalidRequest(f"the body gives the key {key!r} more than once in one object; give each key once", {"key": key}) from None
    except json.JSONDecodeError as error:
        where = "it is empty" if not text.strip() else f"{error.msg} at line {error.lineno} column {error.colno}"
        offset = len(text[: error.pos].encode(encoding, "surrogatepass"))  # in bytes, as a refusal of bytes not UTF-8 says
        raise InvalidRequest(f"the body is not valid JSON: {where}", {"offset": offset}) from None
    except _NotJson as error:
        raise InvalidRequest(f"the body is not valid JSON: {error} is no JSON value", {}) from None
    except RecursionError:
        raise InvalidRequest("the body nests arrays or objects too deeply to be read") from None
    except ValueError:  # an integer longer than Python reads
        raise InvalidRequest(f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _NotJson(ValueError):
    """NaN or Infinity, which json.loads reads though JSON has no such values."""


def _no_constant(name: str) -> Any:
    raise _NotJson(name)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose every key is given once: json.loads keeps the last of two, so `{"gpu_memory": "1GiB",
    "gpu_memory": "20GiB"}` would ask for 20 GiB whichever one its writer meant."""
    decoded = dict(pairs)
    if len(decoded) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return decoded


# NaN and Infinity are not JSON; a key given twice in one object is refused, at any depth.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_no_duplicate_keys)


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}, not {value!r}", {"field": name})
    return int(value)


def _token(request: web.Request) -> str | None:
    return request.headers.get("X-Lease-Token")


def loopback_peer_uid(sock: socket.socket) -> int | None:
    """The uid that owns the other end of a TCP connection from this machine, as the kernel lists it in
    /proc/net/tcp (what identd reads); None for a caller elsewhere, or one not listed (it has gone)."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
        if not is_loopback(peer[0]):
            return None
        table = "/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp"
        # The caller's own socket is listed with its address first and ours second.
        wanted = (_proc_net_address(sock.family, peer[0], peer[1]), _proc_net_address(sock.family, local[0], local[1]))
        with open(table) as lines:
            for line in lines:
                fields = line.split()
                if len(fields) > 7 and (fields[1], fields[2]) == wanted:
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


def _proc_net_address(family: int, host: str, port: int) -> str:
    """An address as /proc/net/tcp writes it: each 32-bit word of the address in host order (little-endian here), in hex."""
    packed = socket.inet_pton(family, host.split("%")[0])
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return f"{words.hex().upper()}:{port:04X}"


async def _stamped_caller(request: web.Request) -> Caller:
    """The caller as a lease request needs it, each part read once per connection, on its first lease request: on the
    Unix socket when its process started (the holder's start time, against a later process with its pid); on TCP, where
    a [[stamp]] names a user, who owns its end of the connection."""
    caller = _caller(request)
    if caller.transport == "unix":
        if caller.pid is None or caller.start_time is not None:
            return caller
        return _keep(request, replace(caller, start_time=holders.start_time(caller.pid)))
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if caller.transport != "tcp" or caller.tcp_uid is not None or sock is None or not request.app[CONFIG].user_stamps:
        return caller
    uid = await asyncio.to_thread(loopback_peer_uid, sock)
    return caller if uid is None else _keep(request, replace(caller, tcp_uid=uid))


def _keep(request: web.Request, caller: Caller) -> Caller:
    """The caller of this request, kept for the next requests on its connection too (not an admin's: that is this request's alone)."""
    request[CALLER] = caller
    if caller.admin is None and request.transport is not None:
        _BY_CONNECTION[request.transport] = caller
    return caller


async def create_lease(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    try:
        lease_request = parse_request(await _json_body(request))
    except InvalidRequest as error:  # refused before any decision: still a lease request, counted by its result
        broker.stats.record(error.code.value, 0.0)
        raise
    caller = await _stamped_caller(request)
    prepared: list[web.Response] = []

    def prepare(lease: Lease, token: str) -> None:
        prepared.append(_created(lease, token))

    try:
        lease, token = await broker.request(lease_request, caller, prepare)
    except Refusal as refusal:
        mesh = request.app[MESH].mesh
        if mesh is not None and refusal.code in ROOM_CODES and lease_request.wants_gpus:
            # A hint, never a decision: where the documents show room now, with how fresh each is (none when pinned to a GPU here).
            hint = mesh.elsewhere(lease_request)
            if hint is not None:
                refusal.details["elsewhere"] = hint
        raise
    # An answer prepared while the grant was syncing, when it was granted at once; else made now.
    return prepared[0] if prepared else _created(lease, token)


def _created(lease: Lease, token: str) -> web.Response:
    return web.Response(body=json.dumps({"lease": lease.to_json(token)}).encode(), status=201, content_type="application/json")


async def list_leases(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    state = request.query.get("state")
    if state is not None and state not in STATES:
        raise InvalidRequest(f"state must be one of {', '.join(STATES)}, not {state!r}", {"field": "state"})
    limit = _int_query(request, "limit", 1000, 1, 100_000)
    node = request.query.get("node") or None  # `node=` left empty: this node
    mesh = request.app[MESH].mesh
    # One node id, resolved once: by a member's id, its admitted name or its document's current name.
    if node is None:
        resolved: str | None = broker.node_id
    elif mesh is not None:
        resolved = mesh.resolve_node(node)
    else:
        resolved = broker.node_id if node in (broker.node_id, broker.config.name) else None
    if resolved is None:
        raise NotFound(
            f"no node {node!r} in {'this cluster' if mesh else 'this single-node broker'}: give a member's id or name", {"node": node}
        )
    if resolved == broker.node_id:
        leases = broker.list_leases(state, limit)
    else:  # another node's: its granted leases as its document lists them (their own node has the rest)
        assert mesh is not None
        leases = mesh.leases_of(resolved, limit) if state in (None, "granted") else []
    return web.json_response({"leases": leases})


async def get_lease(request: web.Request) -> web.Response:
    lease_id = request.match_info["id"]
    try:
        return web.json_response({"lease": request.app[BROKER].get(lease_id)})
    except NotFound:
        mesh = request.app[MESH].mesh
        elsewhere = mesh.lease_of(lease_id) if mesh is not None else None
        if elsewhere is None:
            raise
        # Another node's granted lease, as its document shows it and GET /v1/leases?node= lists it (a release is forwarded there).
        return web.json_response({"lease": elsewhere})


async def renew_lease(request: web.Request) -> web.Response:
    body = await _json_body(request, optional=True)
    if not isinstance(body, dict) or set(body) - {"ttl"}:
        raise InvalidRequest('a renewal is an empty body or {"ttl": DURATION}')
    ttl = None
    if body.get("ttl") is not None:
        try:
            ttl = parse_duration(body["ttl"])
        except UnitError as error:
            raise InvalidRequest(f"ttl: {error}", {"field": "ttl"}) from None
        if ttl < 1:
            raise InvalidRequest("ttl: must be at least 1s", {"field": "ttl"})
    lease = await request.app[BROKER].renew(request.match_info["id"], _caller(request), _token(request), ttl)
    return web.json_response({"lease": lease.to_json()})


async def add_process_group(request: web.Request) -> web.Response:
    body = await _json_body(request)
    pgid = body.get("pgid") if isinstance(body, dict) else None
    if (
        not isinstance(body, dict)
        or set(body) != {"pgid"}
        or isinstance(pgid, bool)
        or not isinstance(pgid, int)
        or not 1 < pgid <= MAX_PID
    ):
        raise InvalidRequest(
            f'register a process group as {{"pgid": N}} with N a process group id, an integer from 2 to {MAX_PID}', {"field": "pgid"}
        )
    lease = await request.app[BROKER].register_group(request.match_info["id"], _caller(request), _token(request), pgid)
    return web.json_response({"lease": lease.to_json()})


async def release_lease(request: web.Request) -> web.Response:
    lease_id = request.match_info["id"]
    caller = _caller(request)
    try:
        lease = await request.app[BROKER].release(lease_id, caller, _token(request))
    except NotFound as missing:
        mesh = request.app[MESH].mesh
        if mesh is None or missing.details.get("cancelled"):
            raise  # no other node to ask, or it was a request waiting here, now cancelled
        forwarded = await mesh.forward_release(lease_id, _token(request), _forwarded_admin(caller))
        if forwarded is None:
            raise
        return web.json_response({"lease": forwarded})  # released by its own node, which authorised it
    return web.json_response({"lease": lease.to_json()})


def _forwarded_admin(caller: Caller) -> str | None:
    """What this node vouches for when it forwards a release: the kind of admin (the owner adds this node's name)."""
    return caller.admin or _socket_admin(caller)


def _socket_admin(caller: Caller) -> str | None:
    """Root or the broker's own user on the Unix socket, who may change the cluster; None for anyone else."""
    if not socket_admin(caller.uid):
        return None
    return ROOT_ON_SOCKET if caller.uid == 0 else OWN_USER_ON_SOCKET


async def node(request: web.Request) -> web.Response:
    return web.json_response(request.app[BROKER].node_json())


def cluster_view(app: web.Application) -> dict[str, Any]:
    """Every node the mesh knows; a broker in no cluster is a cluster of one."""
    mesh = app[MESH].mesh
    if mesh is not None:
        return mesh.cluster_json()
    broker = app[BROKER]
    alone = {"id": broker.node_id, "name": broker.config.name, "state": "alive", "self": True, "age": 0.0, **broker.node_json()}
    return {"nodes": [alone], "coordinator": {"id": broker.node_id, "epoch": 0}}


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(cluster_view(request.app))


def _admin(request: web.Request, doing: str = "changing the cluster") -> None:
    """Changing the cluster (or reading its keyring) takes root or the broker's own Unix user on the socket, or an
    admin (signed in, or the API token)."""
    caller = _caller(request)
    if caller.admin is None and _socket_admin(caller) is None:
        raise Forbidden(f"{doing} takes root or the broker's own user on the Unix socket, or a signed-in admin")


def _mesh(request: web.Request) -> Mesh:
    mesh = request.app[MESH].mesh
    if mesh is None:
        raise Refusal(
            FailureCode.CAPABILITY_UNAVAILABLE,
            "this node belongs to no cluster: run `gpubroker init` first, or `gpubroker up --join TOKEN`",
            {},
        )
    return mesh


async def create_invite(request: web.Request) -> web.Response:
    _admin(request)
    body = await _json_body(request, optional=True)
    if not isinstance(body, dict) or set(body) - {"ttl"}:
        raise InvalidRequest('an invite is an empty body or {"ttl": DURATION}')
    try:
        ttl = parse_duration("1h" if body.get("ttl") is None else body["ttl"])
    except UnitError as error:
        raise InvalidRequest(f"ttl: {error}", {"field": "ttl"}) from None
    if ttl < 1:
        raise InvalidRequest("ttl: an invite lasts at least 1s", {"field": "ttl"})
    return web.json_response({"token": _mesh(request).invite(ttl)}, status=201)


async def list_nodes(request: web.Request) -> web.Response:
    return web.json_response(_mesh(request).nodes_json())


async def remove_node(request: web.Request) -> web.Response:
    _admin(request)
    return web.json_response(await _mesh(request).remove(request.match_info["id"]))


async def approve_node(request: web.Request) -> web.Response:
    _admin(request)
    return web.json_response(_mesh(request).approve(request.match_info["id"]))


async def list_keys(request: web.Request) -> web.Response:
    _admin(request, "reading the cluster's keyring")
    return web.json_response(_mesh(request).keys_json())


async def change_keys(request: web.Request) -> web.Response:
    _admin(request)
    body = await _json_body(request, optional=True)
    if (
        not isinstance(body, dict)
        or set(body) - {"install", "use", "remove"}
        or len(body) != 1
        or not all(isinstance(value, str) or (name == "install" and value is None) for name, value in body.items())
    ):
        raise InvalidRequest('a key change is {"install": KEY or null}, {"use": KEY_ID} or {"remove": KEY_ID}, KEY and KEY_ID strings')
    return web.json_response(await _mesh(request).change_keys(body))


async def events(request: web.Request) -> web.Response:
    after = _int_query(request, "after", 0, 0, 2**62)
    limit = _int_query(request, "limit", 100, 1, 1000)
    broker = request.app[BROKER]
    found, next_seq = broker.events(after, limit)
    return web.json_response({"events": found, "next": next_seq, "dropped": broker.dropped(after, found), "store": broker.store_id})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].negotiate(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type, "Vary": "Accept"})


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return web.json_response(
        {
            "ok": True,
            "node": broker.node_id,
            "driver_error": broker.driver_error,
            "unreadable_gpus": [{k: v for k, v in gpu.items() if k != "leases"} for gpu in broker.unreadable_json()],
            "missing_gpus": [{k: v for k, v in gpu.items() if k != "leases"} for gpu in broker.missing_json()],
            "stale": broker.stale,
            "store_error": broker.store.failing,
        }
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)


def make_app(broker: Broker, mesh: Mesh | MeshSlot | None = None, guard: Guard | None = None) -> web.Application:
    from gpubroker.ui import pages, stream  # they build on this module's keys

    config = broker.config
    app = web.Application(middlewares=[api_middleware], client_max_size=config.max_body)
    answer_unreadable_requests_in_one_shape()
    meet_expectations_after_checks()
    app[BROKER] = broker
    app[CONFIG] = config
    app[CONFIG_HOSTS] = allowed_hosts(config)
    app[GUARD] = guard or Guard(config.ui_password_hash, None, tls=False, sessions=Sessions())
    app[METRICS] = Metrics(broker)
    app[MESH] = mesh if isinstance(mesh, MeshSlot) else MeshSlot(mesh)
    app.router.add_post("/v1/leases", create_lease)
    app.router.add_get("/v1/leases", list_leases)
    app.router.add_get("/v1/leases/{id}", get_lease)
    app.router.add_delete("/v1/leases/{id}", release_lease)
    app.router.add_post("/v1/leases/{id}/renew", renew_lease)
    app.router.add_post("/v1/leases/{id}/processes", add_process_group)
    app.router.add_get("/v1/node", node)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_post("/v1/cluster/invites", create_invite)
    app.router.add_get("/v1/cluster/nodes", list_nodes)
    app.router.add_delete("/v1/cluster/nodes/{id}", remove_node)
    app.router.add_post("/v1/cluster/nodes/{id}/approve", approve_node)
    app.router.add_get("/v1/cluster/keys", list_keys)
    app.router.add_post("/v1/cluster/keys", change_keys)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi)
    app[stream.STREAMS] = stream.Streams()
    app.on_shutdown.append(stream.close_streams)
    app.router.add_get("/v1/stream", stream.stream)
    pages.add_routes(app)
    return app
