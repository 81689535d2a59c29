"""One frozen Config, read from one TOML file; SETTINGS lists every setting with its default and help."""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from socket import gethostname
from typing import Any

from gpubroker.units import UnitError, parse_duration, parse_size

CLASSES = ("production", "interactive", "background", "benchmark", "maintenance")


def default_state_dir() -> Path:
    """`/var/lib/gpubroker` for root, else `$XDG_STATE_HOME/gpubroker` (`~/.local/state/gpubroker`)."""
    if os.geteuid() == 0:
        return Path("/var/lib/gpubroker")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpubroker"


SYSTEM_SOCKET = Path("/run/gpubroker/api.sock")  # a broker run as root (systemd, a root login), reachable by every user


def default_socket() -> Path:
    """The socket `gpubroker up` uses when given none, and where clients look first. Root's is the system's, whatever
    its XDG_RUNTIME_DIR (a root login's `/run/user/0`, which no other user may enter): every user's client looks there
    after its own, and a broker run as root serves the whole machine."""
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):  # a relative one is ignored, as the XDG specification says: it names no one place
        return Path(runtime) / "gpubroker" / "api.sock"
    return default_state_dir() / "api.sock"


@dataclass(frozen=True, slots=True)
class Stamp:
    """Requests from a Unix user or a holder name pattern get this class, whatever they asked."""

    priority: str
    user: str | None = None
    holder: str | None = None

    def matches(self, user: str | None, holder: str | None) -> bool:
        if self.user is not None and self.user != user:
            return False
        if self.holder is not None and (holder is None or not fnmatch.fnmatchcase(holder, self.holder)):
            return False
        return self.user is not None or self.holder is not None


def _node_name(value: Any) -> str:
    """A node's name, as peers, pages and `--node` show and take it: printable, not blank, at most 64 characters."""
    name = value.strip() if isinstance(value, str) else ""
    if not name or len(name) > 64 or not name.isprintable():
        raise ValueError(f"{value!r} is not a node name: 1 to 64 printable characters")
    return name


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any]


def _text(value: Any) -> str:
    """A string, not blank: a list or a number is a mistake in the file, never made into text (`["/x"]` into a path)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not a string of text (quoted, not empty)")
    return value


def _path(value: Any) -> Path:
    return Path(_text(value))


def _host_port(value: Any) -> str:
    """HOST:PORT, an IPv6 address given bare (`::1:9740`) put in brackets: it is printed as a URL's address
    (`http://[::1]:9740`), which a client refuses bare."""
    text = str(value)
    host, sep, port = text.rpartition(":")
    # ASCII digits alone (str.isdigit takes ２ and ², printed back as given in a URL no client reads), and brackets
    # around an IPv6 address only, closed.
    bracketed = host.startswith("[") or host.endswith("]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if bracketed and not (host.startswith("[") and host.endswith("]") and _is_ipv6(host[1:-1])):
        raise ValueError(f"{text!r} is not HOST:PORT (an IPv6 address goes in brackets, with its port: [::1]:9740)")
    if ":" in host and not host.startswith("["):
        try:
            ipaddress.ip_address(host)
        except ValueError:  # `::1` alone: its last group taken for the port would leave `[:]:1`
            raise ValueError(f"{text!r} is not HOST:PORT (an IPv6 address goes in brackets, with its port: [::1]:9740)") from None
        return f"[{host}]:{port}"
    return text


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def _at_least(parse: Callable[[Any], float], least: float, shown: str) -> Callable[[Any], Any]:
    """`parse`, refusing a value under `least` (a setting that could not work)."""

    def checked(value: Any) -> Any:
        parsed = parse(value)
        if parsed < least:
            raise ValueError(f"{value!r} is under the least it may be, {shown}")
        return parsed

    return checked


def _peers(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{value!r} is not a list of HOST:PORT")
    return tuple(_host_port(v) for v in value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1000 <= value <= 1000:
        raise ValueError(f"{value!r} is not an integer from -1000 to 1000")
    return value


_HOST_NAME = re.compile(r"[^\s:/\[\]@]+")


def _hosts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
        raise ValueError(f"{value!r} is not a list of host names")
    for host in value:  # compared with a Host header's name alone: `tower.lan:9740` or `[fe80::1]` would never match
        if not _HOST_NAME.fullmatch(host) and not _is_address(host):
            raise ValueError(f"{host!r} is not a host name or address: give it with no port or brackets, as tower.lan or fe80::1")
    return tuple(value)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _advertise(value: Any) -> str:
    """A host name or address alone: peers are given it with the gossip port, so `10.0.0.5:9741` would be called
    at `10.0.0.5:9741` port 9741, and never answer."""
    host = _text(value)
    if not _HOST_NAME.fullmatch(host) and not _is_address(host):
        raise ValueError(f"{host!r} is not a host name or address: give it with no port or brackets, as 192.168.1.20 or tower.lan")
    return host


def _password_hash(value: Any) -> str:
    from gpubroker.ui.auth import parse_hash  # standard library only; imported where used

    text = str(value)
    parse_hash(text)
    return text


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "state_dir",
        None,
        "where LMDB keeps leases, epochs and events (default: /var/lib/gpubroker as root, else ~/.local/state/gpubroker)",
        _path,
    ),
    Setting("listen", "127.0.0.1:9740", "TCP address of the HTTP API and metrics", _host_port),
    Setting(
        "socket",
        None,
        "Unix socket of the HTTP API (default: /run/gpubroker/api.sock as root, else $XDG_RUNTIME_DIR/gpubroker/api.sock, else in the default state directory)",
        _path,
    ),
    Setting("name", None, "this node's name (default: the name it was admitted to its cluster with, else the hostname)", _node_name),
    Setting(
        "simulate_gpus", None, "simulated GPUs instead of NVML: a spec like 2x24GiB,1x12GiB or a TOML file re-read at every sample", _text
    ),
    Setting("reserve", 2**30, "memory per GPU that is never leased: the safety margin", parse_size),
    Setting(
        "staleness",
        5.0,
        "a GPU decision is never made on a reading older than this (at least 100ms, and longer than sample_interval)",
        _at_least(parse_duration, 0.1, "0.1s"),
    ),
    Setting("sample_interval", 1.0, "how often the GPUs are read (at least 100ms)", _at_least(parse_duration, 0.1, "0.1s")),
    Setting("queue_limit", 16, "waiting requests per class on this node; the next gets QUEUE_FULL", _positive_int),
    Setting(
        "default_ttl",
        300.0,
        "a lease's lifetime unless the request gives a ttl (at least 1s, as a request's)",
        _at_least(parse_duration, 1.0, "1s"),
    ),
    Setting("kill_grace", 10.0, "after a holder dies, its process groups get SIGTERM, then SIGKILL after this", parse_duration),
    Setting("reclaim_grace", 10.0, "after a release, GPU memory still in use after this raises GPU_MEMORY_NOT_RECLAIMED", parse_duration),
    Setting("production_eligible", True, "whether this node serves production requests (else CAPABILITY_UNAVAILABLE)", _bool),
    Setting(
        "allowed_hosts",
        (),
        "names or addresses (no port) accepted in the Host header besides localhost, the listen address and this machine's names (against DNS rebinding)",
        _hosts,
    ),
    Setting(
        "ui_password_hash",
        None,
        "the web UI's password as an scrypt hash from `gpubroker password`; needed to listen beyond loopback",
        _password_hash,
    ),
    Setting(
        "max_body", 64 * 2**10, "the largest request body accepted (larger gets 413; at least 1KiB)", _at_least(parse_size, 2**10, "1KiB")
    ),
    Setting("events_kept", 10_000, "events kept in the store; older ones are dropped", _positive_int),
    Setting("leases_kept", 1_000, "ended leases kept in the store for `leases --state released`", _positive_int),
    Setting(
        "store_size",
        2**30,
        "the most the LMDB store may grow to; when full, requests fail with STORE_FULL (at least 1MiB)",
        _at_least(parse_size, 2**20, "1MiB"),
    ),
    Setting("gossip", "0.0.0.0:9741", "where the mesh listens, UDP and TCP (once this node belongs to a cluster)", _host_port),
    Setting(
        "advertise",
        None,
        "the address peers should use to reach this node, no port (default: the address gossip is bound to; for a "
        "wildcard, the first non-loopback IPv4 address)",
        _advertise,
    ),
    Setting("peers", (), "seed addresses HOST:PORT of other members, for networks where mDNS does not pass", _peers),
    Setting("coordinator_priority", 0, "lower is preferred when the mesh chooses its coordinator", _int),
    Setting("mdns", True, "find peers on the LAN by mDNS", _bool),
)
_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True, slots=True)
class Config:
    state_dir: Path = field(default_factory=default_state_dir)
    listen: str = "127.0.0.1:9740"
    socket: Path | None = None
    name: str = field(default_factory=gethostname)
    simulate_gpus: str | None = None
    reserve: int = 2**30
    staleness: float = 5.0
    sample_interval: float = 1.0
    queue_limit: int = 16
    default_ttl: float = 300.0
    kill_grace: float = 10.0
    reclaim_grace: float = 10.0
    production_eligible: bool = True
    allowed_hosts: tuple[str, ...] = ()
    ui_password_hash: str | None = None
    max_body: int = 64 * 2**10
    events_kept: int = 10_000
    leases_kept: int = 1_000
    store_size: int = 2**30
    gossip: str = "0.0.0.0:9741"
    advertise: str | None = None
    peers: tuple[str, ...] = ()
    coordinator_priority: int = 0
    mdns: bool = True
    stamps: tuple[Stamp, ...] = ()

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else default_socket()

    @property
    def user_stamps(self) -> bool:
        """Whether a stamp names a Unix user: then a TCP caller's user is looked up too."""
        return any(stamp.user is not None for stamp in self.stamps)

    def stamped_class(self, requested: str, user: str | None, holder: str | None) -> str:
        """The class a request gets once this node's stamps are applied."""
        for stamp in self.stamps:
            if stamp.matches(user, holder):
                return stamp.priority
        return requested


def toml_document(data: bytes) -> dict[str, Any]:
    """A TOML file's document; ValueError, naming the line, when it is not TOML, or not UTF-8 as TOML always is
    (whatever the locale says: a file is read the same by a shell and by a service)."""
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (as some editors save one) is no part of the document
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"not UTF-8, as a TOML file must be: byte {data[error.start]:#04x} at line {line}") from None
    return tomllib.loads(text)


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used, named with the setting."""


def _nearest(name: str, known: Iterable[str]) -> str:
    """` (did you mean reserve?)` for a misspelt `reseve` or `Reserve`, else nothing."""
    close = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _parse_setting(name: str, value: Any) -> Any:
    setting = _BY_NAME.get(name)
    if setting is None:
        raise ConfigError(
            f"unknown setting {name!r}{_nearest(name, [*_BY_NAME, 'stamp'])}; the settings are: {', '.join(_BY_NAME)}, [[stamp]]"
        )
    try:
        return setting.parse(value)
    except (ValueError, UnitError, TypeError) as error:
        raise ConfigError(f"setting {name}: {error}") from None


def _parse_stamps(value: Any) -> tuple[Stamp, ...]:
    if not isinstance(value, list):
        raise ConfigError("[[stamp]] must be a list of tables with priority and user or holder")
    stamps = []
    keys = ("priority", "user", "holder")
    for table in value:
        if not isinstance(table, dict):
            raise ConfigError(f"[[stamp]] {table!r}: only priority, user and holder are allowed")
        for key in table:
            if key not in keys:
                raise ConfigError(
                    f"[[stamp]] {table!r}: unknown key {key!r}{_nearest(key, keys)}; only priority, user and holder are allowed"
                )
        if table.get("priority") not in CLASSES:
            raise ConfigError(f"[[stamp]] {table!r}: priority must be one of {', '.join(CLASSES)}")
        if "user" not in table and "holder" not in table:
            raise ConfigError(f"[[stamp]] {table!r}: name a user or a holder pattern")
        for key in ("user", "holder"):  # a uid given as a number (user = 1000) would be compared with user names, never matching
            if key in table and (not isinstance(table[key], str) or not table[key].strip()):
                what = "a Unix user's name" if key == "user" else "a holder name pattern"
                raise ConfigError(f"[[stamp]] {table!r}: {key} must be {what}, quoted and not empty")
        stamps.append(Stamp(table["priority"], table.get("user"), table.get("holder")))
    return tuple(stamps)


def admitted_name(state_dir: Path) -> str | None:
    """The name this node was admitted to its cluster with (given to `gpubroker init`, or to `up --join` or `--ask`), as
    the cluster.json in `state_dir` records it: the name the node goes on with unless one is given. None in no cluster,
    or where that file cannot be read (the broker says why when it starts)."""
    try:
        cluster = json.loads((state_dir / "cluster.json").read_bytes())
        return _node_name(cluster["members"][cluster["node_id"]]["name"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def load_config(path: Path | None = None, **overrides: Any) -> Config:
    """The Config from a TOML file (if any), then flags given as overrides (None = not given)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            document = toml_document(path.read_bytes())
        except OSError as error:
            raise ConfigError(f"{path}: {error.strerror}") from None
        except ValueError as error:  # not TOML (tomllib's TOMLDecodeError), or not UTF-8
            raise ConfigError(f"{path}: {error}") from None
        try:
            for name, value in document.items():
                if name == "stamp":
                    values["stamps"] = _parse_stamps(value)
                else:
                    values[name] = _parse_setting(name, value)
        except ConfigError as error:  # the same setting may also be given as a flag: say which was wrong
            raise ConfigError(f"{path}: {error}") from None
    for name, value in overrides.items():
        if value is not None:
            values[name] = _parse_setting(name, value)
    if "name" not in values and (admitted := admitted_name(values.get("state_dir") or default_state_dir())) is not None:
        values["name"] = admitted
    config = replace(Config(), **values)
    if config.staleness <= config.sample_interval:  # both are set in the file alone (no flag gives either)
        raise ConfigError(
            f"{path}: staleness ({config.staleness:g}s) must be longer than sample_interval ({config.sample_interval:g}s): "
            "a GPU decision needs a reading younger than staleness, and readings come every sample_interval"
        )
    return config
