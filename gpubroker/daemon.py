"""The broker process: the store, the probes, the API on the Unix socket and on TCP, one TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import pwd
import resource
import signal
import socket
import ssl
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import psutil
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gpubroker.broker.nvml import NvmlProbe
from gpubroker.broker.probes import GpuProbe, SimulatedProbe
from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store, StoreDamaged
from gpubroker.config import Config
from gpubroker.ui import api
from gpubroker.ui.api import MeshSlot, allowed_hosts, make_app, unreadable_detail
from gpubroker.ui.auth import Guard, Sessions, is_loopback, load_or_create_api_token
from gpubroker.units import gib, log_line

if TYPE_CHECKING:
    from gpubroker.gossip.mesh import Mesh

NODE_ID_FILE = Path("identity") / "node_id"  # read without loading the crypto stack: a lone broker stays small


class StartError(Exception):
    """The broker cannot start: the message says why and what to do."""


class BrokerRunning(StartError):
    """Another broker holds the state directory."""


def make_probe(config: Config) -> GpuProbe:
    if config.simulate_gpus:
        return SimulatedProbe(config.simulate_gpus)
    return NvmlProbe()


def make_dirs(path: Path) -> None:
    """Make `path` and its missing parents writable by this user alone, whatever the umask (000 would make them
    writable by all): a local user who could write there could put a cluster, a key or a socket of their own in."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o755)
        except FileExistsError:
            continue  # made meanwhile by someone else: refused below if others may write it or own it
        os.chmod(directory, stat.S_IMODE(directory.stat().st_mode) & ~0o022)  # the umask may narrow the mode, never widen it


def writable_by_others(directory: Path, sticky_protects: bool = False) -> bool:
    """Whether users other than its owner and group may change what `directory` holds (a sticky bit, as on /tmp, keeps
    them from removing or renaming our files there, where `sticky_protects`)."""
    mode = directory.stat().st_mode
    return bool(mode & stat.S_IWOTH) and not (sticky_protects and mode & stat.S_ISVTX)


def owned_by_another(directory: Path) -> tuple[Path, str] | None:
    """The directory, of `directory` and those above it, that belongs to a user neither this one nor root, and that
    user: whoever owns it may change what it holds, whatever its mode (one made first in a sticky /tmp, say), and
    whoever owns a directory above may rename the one below and put another in its place (as sshd's StrictModes)."""
    for place in (directory, *directory.resolve().parents):
        owner = place.stat().st_uid
        if owner not in (os.geteuid(), 0):
            return place, _user_name(owner)
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _owned(directory: Path, taken: tuple[Path, str]) -> str:
    """`directory` belongs to user U / is inside D, which belongs to user U."""
    place, owner = taken
    return f"belongs to user {owner}," if place == directory else f"is inside {place}, which belongs to user {owner},"


def lock_state(state_dir: Path) -> int:
    """One broker per state directory: a second would fight over the same leases."""
    try:
        make_dirs(state_dir)
        if writable_by_others(state_dir):
            raise StartError(
                f"the state directory {state_dir} is writable by every user (mode {stat.S_IMODE(state_dir.stat().st_mode):o}): anyone could "
                f"replace its store, cluster or keys; `chmod o-w {state_dir}`, or give --state another directory"
            )
        if (taken := owned_by_another(state_dir)) is not None:
            raise StartError(
                f"the state directory {state_dir} {_owned(state_dir, taken)} who could replace its store, cluster or keys; "
                "give --state a directory of your own"
            )
        _refuse_what_others_may_change_inside(state_dir)
        # The directory itself is locked: a lock file could be removed as stale, and a second broker started beside the
        # first, both granting the same epochs. Where directories cannot be locked (NFS locks only what is open for
        # writing), a file in it is.
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            raise BrokerRunning(f"another broker is running on {state_dir}") from None
        except OSError:
            os.close(fd)
        fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise StartError(f"cannot use {state_dir} as the state directory: {error.strerror}; give --state another directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BrokerRunning(f"another broker is running on {state_dir}") from None
    except OSError as error:
        os.close(fd)
        raise StartError(f"cannot lock the state directory {state_dir}: {error.strerror}; give --state another directory") from None
    return fd


def _refuse_what_others_may_change_inside(state_dir: Path) -> None:
    """A StartError naming the first thing in the state directory (a subdirectory such as identity/, a file, or where a
    link leads) that another user owns or that is inside a directory they own, or a subdirectory every user may write:
    made before the broker's first start, it would hold the node's private key, store or cluster where they could replace
    or read them."""
    for top, directories, files in os.walk(state_dir):
        for name in (*directories, *files):
            path = Path(top) / name
            try:
                taken = owned_by_another(path)
                # A file others may write is reached only through the directories above it, checked here as well.
                open_to_all = taken is None and path.is_dir() and writable_by_others(path)
            except FileNotFoundError:
                continue  # gone meanwhile, or a link to nothing: nothing of the broker's is kept there
            except OSError as error:
                raise StartError(f"cannot use {state_dir} as the state directory: {path}: {error.strerror}; remove {path}") from None
            if taken is not None:
                raise StartError(
                    f"{path}, in the state directory {state_dir}, {_owned(path, taken)} who could replace or read the node's "
                    f"store, cluster or keys; `chown -R {_user_name(os.geteuid())} {path}` if what it holds is the broker's, "
                    "or remove it"
                )
            if open_to_all:
                raise StartError(
                    f"{path}, in the state directory {state_dir}, is writable by every user (mode "
                    f"{stat.S_IMODE(path.stat().st_mode):o}): anyone could replace the node's store, cluster or keys; "
                    f"`chmod o-w {path}`, or remove it"
                )


SOCKET_PATH_MAX = 107  # bytes: sun_path holds 108, the last a NUL


NEW_STORE_ROOM = 2**20  # bytes free on the state directory's disk below which a new store is not made


def open_store(config: Config) -> Store:
    """The state store, or a StartError saying why it cannot be opened.

    A new store is not made on a disk with less than NEW_STORE_ROOM free: LMDB maps its lock file, and on a
    full disk touching that mapping kills the process with SIGBUS, saying nothing."""
    if not (config.state_dir / "store" / "data.mdb").exists():
        disk = os.statvfs(config.state_dir)
        free = disk.f_bavail * disk.f_frsize
        if free < NEW_STORE_ROOM:
            raise StartError(
                f"the disk of {config.state_dir} has {free} bytes free; a new state store needs at least {NEW_STORE_ROOM // 2**20} MiB"
            )
    try:
        return Store(config.state_dir, config.store_size, config.events_kept)
    except StoreDamaged as error:
        raise StartError(str(error)) from None
    except (lmdb.Error, OSError) as error:
        raise StartError(f"cannot open the state store in {config.state_dir}: {error}; check store_size and the directory") from None


def _free_socket(path: Path) -> None:
    """Remove a stale socket left by a broker that died; refuse if a live one answers there, or if the path
    is something other than a socket (a file there is never removed), or too long to be one."""
    if (length := len(os.fsencode(path))) > SOCKET_PATH_MAX:
        raise StartError(f"the socket path {path} is {length} bytes; a Unix socket's is at most {SOCKET_PATH_MAX}: give a shorter --socket")
    try:
        make_dirs(path.parent)
        if writable_by_others(path.parent, sticky_protects=True):
            raise StartError(
                f"the socket's directory {path.parent} is writable by every user and not sticky: anyone could put a socket of their "
                f"own in the broker's place and read its callers' tokens; `chmod o-w {path.parent}`, or give --socket another path"
            )
        if (taken := owned_by_another(path.parent)) is not None:
            raise StartError(
                f"the socket's directory {path.parent} {_owned(path.parent, taken)} who could put a socket of their own in the "
                "broker's place and read its callers' tokens; give --socket a path in a directory of your own"
            )
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise StartError(f"cannot make the socket {path}: {error.strerror}; give --socket another path") from None
    if not stat.S_ISSOCK(mode):
        raise StartError(f"{path} exists and is not a socket; give --socket another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            try:
                path.unlink()
            except OSError as error:  # another user's, in a sticky /tmp, say
                raise StartError(
                    f"cannot remove {path}, a socket no broker answers on: {error.strerror}; remove it, or give --socket another path"
                ) from None
            return
    raise StartError(f"another broker answers on {path}; stop it or give --socket")


def _same_file(path: Path, bound: os.stat_result | None) -> bool:
    """Whether `path` is still the file `bound` describes (the socket this broker made, not a later broker's)."""
    try:
        now = path.lstat()
    except OSError:
        return False
    return bound is not None and (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino)


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def default_advertise(gossip: str) -> str:
    """Where peers reach a mesh listening on `gossip`: the address it is bound to, when it is bound to one (a name is
    looked up as the bind looks it up); for a wildcard bind, the first non-loopback IPv4 address of this host, else
    loopback."""
    host, port = _addr(gossip)
    with contextlib.suppress(OSError, UnicodeError):  # a name that does not resolve: the bind says so
        bound = str(socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][4][0])
        if not ipaddress.ip_address(bound.partition("%")[0]).is_unspecified:
            return bound
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return "127.0.0.1"


def load_identity(state_dir: Path) -> Any:
    """This node's Ed25519 identity (made on first use), its id also written where a lone broker reads it."""
    from gpubroker.gossip.identity import Identity

    identity = Identity.load_or_create(state_dir)
    path = state_dir / NODE_ID_FILE
    if not path.exists() or path.read_text().strip() != identity.node_id:
        path.write_text(identity.node_id + "\n")
    return identity


def known_node_id(state_dir: Path) -> str | None:
    try:
        return (state_dir / NODE_ID_FILE).read_text().strip() or None
    except OSError:
        return None


def _mesh_settings(config: Config, seeds: tuple[tuple[str, int], ...]) -> Any:
    from gpubroker.gossip.mesh import MeshSettings

    return MeshSettings(
        gossip=_addr(config.gossip),
        advertise=config.advertise or default_advertise(config.gossip),
        peers=seeds,
        priority=config.coordinator_priority,
        mdns=config.mdns,
    )


async def _ask_then_mesh(config: Config, broker: Broker, slot: MeshSlot) -> None:
    """No cluster, no token: ask the members found to admit this node, and run the mesh once one does."""
    from gpubroker.gossip.mesh import Asker, Mesh

    identity = load_identity(config.state_dir)
    settings = _mesh_settings(config, tuple(_addr(p) for p in config.peers))
    asker = Asker(settings, identity, config.name, config.state_dir, lambda kind, text: broker.record_event(kind, text))
    cluster = await asker.run()
    broker.record_event("mesh.join.admitted", "this node was approved and joins its cluster", details={"node": identity.node_id})
    slot.mesh = Mesh(settings, broker, identity, cluster)
    await slot.mesh.run()


async def _make_mesh(config: Config, broker: Broker, join: str | None) -> Mesh | None:
    """The mesh if this node belongs to a cluster (or joins one now); None for a lone broker."""
    if join is None and not (config.state_dir / "cluster.json").exists():
        return None  # a lone broker never loads the mesh's modules (cryptography, zeroconf): it stays small
    from gpubroker.gossip.cluster import ClusterError, ClusterState, decode_token
    from gpubroker.gossip.keyring import cluster_hash
    from gpubroker.gossip.mesh import Mesh, join_cluster
    from gpubroker.gossip.transport import PeerError

    identity = load_identity(config.state_dir)
    if broker.node_id != identity.node_id:
        raise StartError(f"{config.state_dir} holds leases of node {broker.node_id}, not of this identity {identity.node_id}")
    seeds = tuple(_addr(p) for p in config.peers)
    try:
        cluster = ClusterState.load(config.state_dir)
        if join is not None and cluster is None:
            cluster = await join_cluster(join, identity, config.name, config.state_dir)
            seeds += (decode_token(join).seed,)  # the member that admitted us is the first to talk to
        elif join is not None and cluster is not None:
            mine, theirs = cluster_hash(cluster.cluster_id), decode_token(join).cluster
            if cluster.is_removed(identity.node_id):
                raise StartError(
                    f"this node was removed from cluster {mine}: to join again it needs a new identity, "
                    "a fresh --state with `gpubroker up --join TOKEN`"
                )
            if theirs != mine:
                raise StartError(
                    f"{config.state_dir} already belongs to cluster {mine}, and this token is for cluster {theirs}: to move this node, "
                    f"remove it there (`gpubroker nodes remove {identity.node_id}` on a member), then start it with a fresh --state "
                    "and --join TOKEN"
                )
            # Started again as it was first started (shell history, a service's command line): it is a member already.
            log_line(f"this node already belongs to cluster {mine}: --join was not used (it is needed only the first time)")
            seeds += (decode_token(join).seed,)  # a member still, where mDNS may not pass
    except (ClusterError, PeerError) as error:
        raise StartError(f"cannot join: {error}") from None
    if cluster is None:
        return None
    return Mesh(_mesh_settings(config, seeds), broker, identity, cluster)


UI_CERT_RENEW = 30 * 86400  # a UI certificate this close to its end is made anew at start


def _ui_tls(config: Config) -> ssl.SSLContext:
    """HTTPS for a LAN address: this node's ECDSA P-256 certificate (browsers refuse Ed25519), made once and kept
    in the state directory, made anew when it no longer names this broker's addresses or is near its end."""
    from cryptography import x509

    from gpubroker.gossip.identity import ui_certificate, write_private

    directory = config.state_dir / "ui"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    # Every name the broker may be reached by; the first, a name of this machine, is the subject's.
    names = sorted((h for h in allowed_hosts(config) if h not in ("0.0.0.0", "::")), key=lambda h: (is_loopback(h), h))
    current = None
    with contextlib.suppress(OSError, ValueError):
        current = x509.load_pem_x509_certificate(cert_path.read_bytes())
    usable = False
    if current is not None and key_path.exists():
        try:
            sans = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            covered = {str(v) for v in sans.get_values_for_type(x509.DNSName)} | {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
        except x509.ExtensionNotFound:
            covered = set()
        usable = set(names) <= covered and current.not_valid_after_utc.timestamp() - time.time() > UI_CERT_RENEW
    if not usable:
        cert_pem, key_pem = ui_certificate(names)
        write_private(key_path, key_pem)
        write_private(cert_path, cert_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context


def beyond_loopback(config: Config) -> bool:
    """Whether the API listens where other machines reach it: then a password and HTTPS are required."""
    return not is_loopback(config.listen.rpartition(":")[0])


def make_guard(config: Config) -> tuple[Guard, ssl.SSLContext | None]:
    """What TCP callers must show, and HTTPS where the API listens beyond loopback (which takes a UI password)."""
    lan = beyond_loopback(config)
    if lan and config.ui_password_hash is None:
        raise StartError(
            f"refusing to listen on {config.listen} without a UI password: set ui_password_hash in the config file "
            "(`gpubroker password` makes one), or listen on 127.0.0.1"
        )
    token = load_or_create_api_token(config.state_dir) if config.ui_password_hash is not None else None
    return Guard(config.ui_password_hash, token, tls=lan, sessions=Sessions()), _ui_tls(config) if lan else None


class _UnreadableRequests(logging.Filter):
    """A request the HTTP parser cannot read (a byte no URL may hold) is the caller's mistake, answered 400
    by aiohttp itself: one line in the log, not an error with a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        problem = record.exc_info[1] if record.exc_info else None
        # RequestPayloadError: a body the API could not read (and answered 400), whose rest aiohttp then failed to skip.
        if isinstance(problem, HttpProcessingError | RequestPayloadError):
            record.msg, record.args, record.exc_info = "refused a request it cannot read: %s", (unreadable_detail(problem),), None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_UNREADABLE = _UnreadableRequests()


async def serve(
    config: Config,
    probe: GpuProbe | None = None,
    on_ready: Callable[[Broker], None] | None = None,
    join: str | None = None,
    ask: bool = False,
) -> None:
    """Run the broker (and its mesh, in a cluster) until cancelled; closing is idempotent and leaves the store consistent."""
    logging.getLogger("aiohttp.server").addFilter(_UNREADABLE)
    if join is not None:  # a token that cannot be read is refused before anything is made in the state directory
        from gpubroker.gossip.cluster import ClusterError, decode_token

        try:
            decode_token(join)
        except ClusterError as error:
            raise StartError(f"cannot join: {error}") from None
    lock = lock_state(config.state_dir)
    any_port: socket.socket | None = None
    try:
        config, any_port = _bind_any_port(config)
        try:
            guard, tls = make_guard(config)
        except OSError as error:
            raise StartError(f"cannot keep the API token in {config.state_dir}: {error.strerror}") from None
        if (join is not None or ask) and known_node_id(config.state_dir) is None:
            load_identity(config.state_dir)  # a joining node's leases carry the id it will have in the cluster
        store = open_store(config)
        broker = Broker(config, store, probe or make_probe(config), node_id=known_node_id(config.state_dir))
        try:
            await broker.start()
        except StoreDamaged as error:
            store.stop()
            raise StartError(str(error)) from None
        try:
            mesh = await _make_mesh(config, broker, join)
        except BaseException:
            await broker.close()
            raise
        slot = MeshSlot(mesh)
        runner = web.AppRunner(
            make_app(broker, slot, guard), handler_cancellation=True, access_log=None, keepalive_timeout=api.IDLE_TIMEOUT
        )
        bound: os.stat_result | None = None
        try:
            await runner.setup()
            sock_path = config.socket_path
            _free_socket(sock_path)
            try:
                await web.UnixSite(runner, str(sock_path)).start()
            except OSError as error:
                raise StartError(f"cannot listen on {sock_path}: {error.strerror}; give --socket another path") from None
            bound = sock_path.lstat()  # removed at the end only while it is still this one
            os.chmod(sock_path, 0o666)  # any local user may ask; the kernel tells us who they are
            host, _, port = config.listen.rpartition(":")
            try:
                if any_port is not None:
                    site: web.BaseSite = web.SockSite(runner, any_port, ssl_context=tls)
                    any_port = None  # the site's now, closed with it
                else:
                    site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=tls)
                await site.start()
            except OSError as error:
                raise StartError(f"cannot listen on {config.listen}: {error.strerror}; give --listen HOST:PORT") from None
            if on_ready is not None:
                on_ready(broker)
            async with asyncio.TaskGroup() as group:
                group.create_task(broker.run())
                if mesh is not None:
                    group.create_task(mesh.run())
                elif ask:
                    group.create_task(_ask_then_mesh(config, broker, slot))
        finally:
            broker.stop_waiting()  # before the server waits for its handlers: a waiting request's may wait forever
            await runner.cleanup()
            await broker.close()
            if _same_file(config.socket_path, bound):
                with contextlib.suppress(OSError):
                    config.socket_path.unlink()
    finally:
        if any_port is not None:
            any_port.close()
        os.close(lock)


def _bind_any_port(config: Config) -> tuple[Config, socket.socket | None]:
    """`--listen HOST:0`: the port the kernel picks is bound at once, so that the ready line, and the address a cluster's
    members are told, give the port the API is on rather than 0. Any other port is bound by the API's own site."""
    host, _, port = config.listen.rpartition(":")
    if int(port) != 0:
        return config, None
    bare = host.strip("[]")
    try:
        sock = socket.create_server((bare, 0), family=socket.AF_INET6 if ":" in bare else socket.AF_INET)
    except OSError as error:
        raise StartError(f"cannot listen on {config.listen}: {error.strerror}; give --listen HOST:PORT") from None
    return replace(config, listen=f"{host}:{sock.getsockname()[1]}"), sock


def raise_open_files_limit() -> None:
    """Every connection holds a file descriptor: the soft limit (often 1024 from a shell) is raised to the
    hard one, as servers do, so that many clients, or a careless one, do not run the broker out of them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 2**20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def config_warnings(config: Config, broker: Broker) -> list[str]:
    """Settings that start a broker but cannot do what they say: said once, at start."""
    warnings = []
    for stamp in config.stamps:
        if stamp.user is not None:
            try:
                pwd.getpwnam(stamp.user)
            except KeyError:
                warnings.append(f"[[stamp]] user {stamp.user!r} is no user of this machine: that stamp never applies")
        if stamp.priority == "production" and not config.production_eligible:
            whose = " with ".join(
                ([f"user {stamp.user!r}"] if stamp.user is not None else [])
                + ([f"holder {stamp.holder!r}"] if stamp.holder is not None else [])
            )
            warnings.append(
                f"[[stamp]] makes the requests of {whose} production, and production_eligible is false: every one of them "
                "is refused CAPABILITY_UNAVAILABLE"
            )
    history = 2 * (config.leases_kept * 1024 + config.events_kept * 512)  # what the kept history takes, about, and room to rewrite it
    if config.store_size < history:
        warnings.append(
            f"store_size ({config.store_size / 2**20:.1f} MiB) may be filled by the history it keeps (leases_kept {config.leases_kept}, "
            f"events_kept {config.events_kept}) before any is dropped: give it {history / 2**20:.0f} MiB or more, or keep less"
        )
    totals = [reading.total for reading in broker.readings]
    if totals and all(config.reserve >= total for total in totals):
        warnings.append(f"reserve ({gib(config.reserve)} GiB) is as large as every GPU: no GPU memory can be leased")
    # A setting changed between two runs while leases were kept: they keep what they were granted, said here once.
    for budget in broker.budgets():
        declared, total = budget.held.declared, budget.figures.total
        if declared and declared + config.reserve > total and config.reserve < total:
            warnings.append(
                f"{budget.label()}: the leases kept on it ({gib(declared)} GiB) and reserve ({gib(config.reserve)} GiB) come to more "
                "than the GPU: the leases keep their memory, and nothing more is leased there until enough of them end"
            )
    production = sorted(lease.id for lease in broker.leases.values() if lease.priority == "production" and lease.live)
    if production and not config.production_eligible:
        warnings.append(
            f"production_eligible is false, yet {len(production)} production lease{'s' * (len(production) != 1)} "
            f"{'are' if len(production) != 1 else 'is'} kept ({', '.join(production)}): each goes on until it ends; "
            "no new production request is served"
        )
    return warnings


def run(config: Config, join: str | None = None, ask: bool = False) -> int:
    """`gpubroker up`: run in the foreground until SIGINT, SIGTERM or SIGHUP."""
    raise_open_files_limit()

    def ready(broker: Broker) -> None:
        gpus = len(broker.readings)
        source = f"simulated ({config.simulate_gpus})" if config.simulate_gpus else "NVML"
        state = f"GPUs: {broker.driver_error}" if broker.driver_error else f"{gpus} GPU{'s' * (gpus != 1)} via {source}"
        if broker.driver_error is None and broker.unreadable:
            state += "".join(f" ({gpu.label()} cannot be read: {gpu.error})" for gpu in broker.unreadable)
        for gpu in broker.missing_json():  # the log says only what changes after the first reading
            held = f"leases {', '.join(gpu['leases'])} hold {gib(gpu['bytes'])} GiB on it"
            state += f" ({gpu['uuid']} is no longer listed by the driver: {held})"
        # In full: a relative --state or --socket names nothing from another directory (a shell's GPUBROKER_URL=unix:…).
        print(
            f"gpubroker ready: node {config.name} ({broker.node_id}), {state}; "
            f"API on unix:{config.socket_path.absolute()} and {'https' if beyond_loopback(config) else 'http'}://{broker.config.listen}"
            f"{' (signed-in UI, API token)' if config.ui_password_hash else ''}; state in {config.state_dir.absolute()}",
            flush=True,
        )
        if broker.start_warning is not None:
            log_line(broker.start_warning)
        for warning in config_warnings(config, broker):
            log_line(f"warning: {warning}")

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            task.cancel()  # first: a log nobody reads any more must not keep the broker from stopping
            log_line(f"{signal.Signals(signum).name}: stopping")

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # SIGHUP (its terminal gone) stops it as the others do, said and cleanly, where it used to kill it silently;
            # one its starter ignored (`nohup gpubroker up`) stays ignored: it was asked to outlive the terminal.
            if signum != signal.SIGHUP or signal.getsignal(signum) != signal.SIG_IGN:
                loop.add_signal_handler(signum, stop, signum)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(config, on_ready=ready, join=join, ask=ask)
            return
        log_line("stopped")

    try:
        asyncio.run(main())
    except BrokerRunning as error:
        print(f"gpubroker: {error}: stop it first, or give --state another directory for a broker of its own", file=sys.stderr)
        return 2
    except StartError as error:
        print(f"gpubroker: {error}", file=sys.stderr)
        return 2
    return 0
