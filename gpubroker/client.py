"""A small blocking client of the HTTP API, over the Unix socket or TCP (standard library only)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from gpubroker.config import SYSTEM_SOCKET, default_socket

DEFAULT_URL = "http://127.0.0.1:9740"


class ClientError(Exception):
    """The broker answered with a typed failure, or could not be reached."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the broker is: `unix:PATH`, `http://HOST:PORT` or `https://HOST:PORT`."""

    url: str
    searched: tuple[str, ...] = ()  # the sockets looked at first, where no GPUBROKER_URL named one
    denied: tuple[str, ...] = ()  # of those, the ones this user may not reach: a broker may well answer there

    @property
    def is_unix(self) -> bool:
        return self.url.startswith("unix:")

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self.is_unix:
            return _UnixConnection(self.url[len("unix:") :], timeout)
        parts = urlsplit(self.url)
        if parts.scheme == "https":
            # The broker's certificate is its own (self-signed): GPUBROKER_CA names a copy of it, STATE/ui/cert.pem.
            ca = os.environ.get("GPUBROKER_CA")
            return http.client.HTTPSConnection(parts.netloc, timeout=timeout, context=ssl.create_default_context(cafile=ca or None))
        return http.client.HTTPConnection(parts.netloc, timeout=timeout)


def find_broker(env: dict[str, str] | None = None) -> Endpoint:
    """GPUBROKER_URL, then the default socket (this user's, then the system's), then http://127.0.0.1:9740."""
    env = dict(os.environ) if env is None else env
    url = env.get("GPUBROKER_URL")
    if url:
        # Not said back: what precedes the @ may be a password, and one holding a / (or ? or #) ends the address there.
        if not url.startswith("unix:") and "@" in url:
            raise ClientError(
                0,
                "INVALID_REQUEST",
                "GPUBROKER_URL names a user (USER@HOST): the broker takes none in its address; give http(s)://HOST:PORT, "
                "and the API token, where one is needed, in GPUBROKER_TOKEN",
            )
        if not _is_address(url):
            address = url.partition("://")[2].split("/")[0]
            bare = address.count(":") > 1 and "[" not in address  # http://::1:9740
            hint = " (an IPv6 address goes in brackets: http://[::1]:9740)" if bare else ""
            raise ClientError(0, "INVALID_REQUEST", f"GPUBROKER_URL={url!r} is not unix:PATH, http://HOST:PORT or https://HOST:PORT{hint}")
        return Endpoint(url)
    sockets = tuple(dict.fromkeys((default_socket(), SYSTEM_SOCKET)))  # one, for root
    denied = []
    for path in sockets:
        listening = _listening(path)
        if listening:
            return Endpoint(f"unix:{path}")
        if listening is None:
            denied.append(str(path))
    return Endpoint(DEFAULT_URL, searched=tuple(str(path) for path in sockets), denied=tuple(denied))


def _is_address(url: str) -> bool:
    """Whether a GPUBROKER_URL names a socket or a host and port (a port that is no number, or a bracket left open,
    would otherwise end the command in a traceback)."""
    if url.startswith("unix:"):
        return len(url) > len("unix:")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (read for the ValueError of a port that is no number or out of range)
    except ValueError:
        return False
    # A path is no part of the broker's address (`http://HOST:PORT/v1`): the client's paths would be read without it.
    return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/") and not parts.query


def _listening(path: Path) -> bool | None:
    """Whether a broker answers on the socket; None where this user may not reach it (a directory closed to others)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(path))
        return True
    except PermissionError:
        return None
    except OSError:
        return False


def _kept_from(path: str, why: str) -> str:
    return (
        f"this user (uid {os.getuid()}) may not reach the socket {path} ({why}): it, or a directory above it, is closed to "
        "other users; the broker's user may give --socket a path every user can reach, or name the broker's TCP address in "
        "GPUBROKER_URL (http://HOST:PORT, its --listen)"
    )


class Client:
    def __init__(self, endpoint: Endpoint | None = None, timeout: float | None = 30.0) -> None:
        self.endpoint = endpoint or find_broker()
        self.timeout = timeout
        self.token = os.environ.get("GPUBROKER_TOKEN")

    def _refuse_plain_text(self) -> None:
        """The API token goes to another machine only over https: over plain http anyone on the LAN could read it."""
        parts = urlsplit(self.endpoint.url)
        if parts.scheme != "http" or not parts.hostname:
            return
        try:
            loopback = parts.hostname == "localhost" or ipaddress.ip_address(parts.hostname).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ClientError(
                0,
                "INVALID_REQUEST",
                f"GPUBROKER_TOKEN is not sent over plain http to {parts.hostname}, where anyone on the way could read it: "
                f"a broker on a LAN address serves https, so give GPUBROKER_URL=https://{parts.netloc}",
            )

    def _hint(self) -> str:
        """What to do about a broker that does not answer: a socket path that is something else is named as such."""
        path = self.endpoint.url.removeprefix("unix:") if self.endpoint.url.startswith("unix:") else None
        if path is not None and os.path.exists(path) and not stat.S_ISSOCK(os.stat(path).st_mode):
            return f"; {path} is not a socket: give the broker's --socket in GPUBROKER_URL"
        if self.endpoint.searched:  # a broker on a socket or address of its own is found only where it is named
            return (
                f", nor on {' or '.join(self.endpoint.searched)}; start one with `gpubroker up`, or name the one running "
                "elsewhere in GPUBROKER_URL (unix:PATH, its --socket, or http://HOST:PORT, its --listen)"
            )
        return "; start one with `gpubroker up`"

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One request; the decoded JSON answer, or ClientError with the broker's code and message."""
        if query:
            path += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        sent = {"Content-Type": "application/json", **(headers or {})}
        if self.token:
            self._refuse_plain_text()
            sent.setdefault("Authorization", f"Bearer {self.token}")
        payload = json.dumps(body).encode() if body is not None else None
        patience = timeout if timeout is not None else self.timeout
        connection = self.endpoint.connection(patience)
        try:
            connection.request(method, path, body=payload, headers=sent)
            response = connection.getresponse()
            raw = response.read()
        except TimeoutError:
            # Connected, and no answer: a broker stopped (SIGSTOP, a debugger) or wedged, not one that is gone.
            raise ClientError(
                0,
                "TIMEOUT",
                f"the broker at {self.endpoint.url} did not answer {method} {path.partition('?')[0]} within {patience:g}s "
                "(stopped, or far too busy)",
            ) from None
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as error:
            # It was listening, and went away with the request: a change asked for may have been made.
            raise ClientError(
                0,
                "UNREACHABLE",
                f"the broker at {self.endpoint.url} went away while it handled {method} {path.partition('?')[0]} ({error}); "
                "what it asked may or may not have been done: look (`gpubroker leases`, `gpubroker events`) before asking again",
            ) from None
        except ssl.SSLError as error:
            parts = urlsplit(self.endpoint.url)
            if error.reason != "WRONG_VERSION_NUMBER":  # its certificate, say: said as it is
                raise ClientError(0, "UNREACHABLE", f"no broker answers at {self.endpoint.url} ({error})") from None
            raise ClientError(
                0,
                "UNREACHABLE",
                f"the broker at {self.endpoint.url} answers plain http, not https (a broker serves https only on a LAN "
                f"address): give GPUBROKER_URL=http://{parts.netloc}",
            ) from None
        except OSError as error:
            if isinstance(error, PermissionError) and self.endpoint.is_unix:
                # A broker may well answer there: this user is kept from its socket, which starting one would not change,
                # nor waiting (FORBIDDEN: `events --follow` does not wait for it to answer as it waits through a restart).
                raise ClientError(0, "FORBIDDEN", _kept_from(self.endpoint.url.removeprefix("unix:"), str(error.strerror))) from None
            if self.endpoint.denied:  # nothing answers on TCP either: the socket this user is kept from is the likely broker
                raise ClientError(
                    0,
                    "FORBIDDEN",
                    f"no broker answers at {self.endpoint.url} ({error}); {_kept_from(self.endpoint.denied[0], 'Permission denied')}",
                ) from None
            raise ClientError(0, "UNREACHABLE", f"no broker answers at {self.endpoint.url} ({error}){self._hint()}") from None
        finally:
            connection.close()
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"text": raw.decode(errors="replace")}
        if response.status >= 400:
            failure = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise ClientError(
                response.status,
                failure.get("code", str(response.status)),
                failure.get("message", raw.decode(errors="replace")),
                failure.get("details"),
            )
        return answer

    def text(self, path: str) -> str:
        connection = self.endpoint.connection(self.timeout)
        try:
            connection.request("GET", path, headers={"Authorization": f"Bearer {self.token}"} if self.token else {})
            return connection.getresponse().read().decode()
        finally:
            connection.close()
