"""Who may use the web UI and the API over TCP: a UI password, the node's API token, sessions and CSRF tokens.

On loopback without a password nothing changes: the pages are readable by anyone on
this machine, and changes take a lease's token (or the Unix socket, where the kernel
names the caller). Once a password is set — and it must be, for any address beyond
loopback — every page, API call and `/metrics` on TCP needs a signed-in session
(the browser's cookie) or the node's API token (`Authorization: Bearer`, what
`GPUBROKER_TOKEN` sends), and both make the caller an admin of this node. A change
made with the cookie also needs the page's CSRF token; a change whose `Origin` is
not this broker is refused whatever it carries.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1  # ~16 MiB and a few tens of ms per guess
SCRYPT_MEMORY = 2**27  # the most one guess may use; a stored hash may ask for half of it
SESSION_COOKIE = "gpubroker_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf"
SESSION_TTL = 12 * 3600.0
SESSIONS_KEPT = 1000  # the oldest session is dropped beyond this
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
OPEN_PATHS = ("/login", "/static/")  # reachable before signing in


class PasswordError(ValueError):
    """A stored password hash that is not one `gpubroker password` makes."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    """`scrypt$N$r$p$SALT$HASH`, the form of the ui_password_hash setting."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, dklen=32, maxmem=2**26)
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(digest)}"


def parse_hash(stored: str) -> tuple[int, int, int, bytes, bytes]:
    """The parameters, salt and digest of a stored hash; PasswordError names what is wrong."""
    parts = stored.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        raise PasswordError("is not scrypt$N$r$p$SALT$HASH; make one with `gpubroker password`")
    try:
        n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt, digest = _unb64(parts[4]), _unb64(parts[5])
    except ValueError:
        raise PasswordError("has a field that is not a number or base64; make one with `gpubroker password`") from None
    if n < 2**10 or n & (n - 1) or not 1 <= r <= 32 or not 1 <= p <= 16 or len(salt) < 8 or len(digest) < 16:
        raise PasswordError("has parameters out of range; make one with `gpubroker password`")
    if 128 * r * n > SCRYPT_MEMORY // 2:
        raise PasswordError(f"asks scrypt for more than {SCRYPT_MEMORY // 2**21} MiB per guess; make one with `gpubroker password`")
    return n, r, p, salt, digest


def verify_password(password: str, stored: str) -> bool:
    """Whether `password` is the one `stored` was made from (constant time in the digest)."""
    n, r, p, salt, digest = parse_hash(stored)
    guess = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, dklen=len(digest), maxmem=SCRYPT_MEMORY)
    return hmac.compare_digest(guess, digest)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_token_path(state_dir: Path) -> Path:
    return state_dir / "ui" / "api_token"


def load_or_create_api_token(state_dir: Path) -> str:
    """The node's API token, made once (readable by the broker's user alone) and kept across restarts.

    It is written whole to a file of its own, then linked into place: two processes making it at once (the
    broker starting, `gpubroker token`) end with the same one, and nobody ever reads half a token."""
    path = api_token_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        fresh = path.with_name(f".api_token.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(fresh, path)  # the first to link wins; the others read its token below
        finally:
            fresh.unlink()
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)  # a token others can read is no secret
    return path.read_text().strip()


@dataclass(slots=True)
class Session:
    id: str
    csrf: str
    expires: float


class Sessions:
    """Signed-in browsers, in memory: a restart signs everyone out."""

    def __init__(self, ttl: float = SESSION_TTL, kept: int = SESSIONS_KEPT) -> None:
        self.ttl = ttl
        self.kept = kept
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def create(self) -> Session:
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.monotonic() + self.ttl)
        self._by_id[session.id] = session
        while len(self._by_id) > self.kept:
            self._by_id.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        session = self._by_id.get(session_id or "")
        if session is None:
            return None
        if session.expires < time.monotonic():
            del self._by_id[session.id]
            return None
        return session

    def drop(self, session_id: str | None) -> None:
        self._by_id.pop(session_id or "", None)


@dataclass(slots=True)
class Guard:
    """What this node asks of TCP callers: nothing (loopback, no password), or a session or the API token."""

    password_hash: str | None
    api_token: str | None
    tls: bool
    sessions: Sessions

    @property
    def required(self) -> bool:
        return self.password_hash is not None

    def token_matches(self, presented: str) -> bool:
        return self.api_token is not None and hmac.compare_digest(presented.encode(), self.api_token.encode())

    def csrf_matches(self, session: Session, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), session.csrf.encode())
