"""The web UI's pages, rendered on the server from the API's own data: Cluster, Node, Leases, Events, Mesh.

Standard library only (html.escape and small helpers): no template engine, no build
step, every asset served by the binary. A page is a shell around one live region;
`/fragment/<page>` renders that region alone, which live.js fetches again when the
event stream says something changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

from aiohttp import web

from gpubroker.errors import FailureCode, NotFound
from gpubroker.gossip.documents import external_by_name, listed_leases, listed_missing, listed_unreadable
from gpubroker.ui.api import BROKER, CALLER, CONFIG, GUARD, MESH, SESSION, STATES, cluster_view, read_form
from gpubroker.ui.auth import CSRF_FIELD, SESSION_COOKIE, verify_password
from gpubroker.ui.stream import EVENT_TYPES
from gpubroker.units import rfc3339

STATIC = Path(__file__).parent / "static"


@dataclass(slots=True)
class SignIns:
    """Guesses at the UI password, checked one at a time on a thread of their own (scrypt makes each cost tens of
    milliseconds, and the shared threads read the GPUs). A guess is counted from when it is handed over until
    its check has finished, even if its client has gone; at most PER_ADDRESS are pending from one address and
    PENDING from all, and more are refused at once, so a flood of wrong guesses from one place can neither
    queue up in front of the right one from another nor pile up in memory."""

    PENDING: ClassVar[int] = 32
    PER_ADDRESS: ClassVar[int] = 2
    pending: dict[str, int] = field(default_factory=dict)
    checker: ThreadPoolExecutor | None = None

    @staticmethod
    def source(remote: str | None) -> str:
        """Whom to count a guess against: the client's address, or for IPv6 its /64 (a host may hold all of it)."""
        try:
            ip = ipaddress.ip_address(remote or "")
        except ValueError:
            return remote or "unknown"
        if isinstance(ip, ipaddress.IPv6Address):
            return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def admit(self, address: str) -> bool:
        if sum(self.pending.values()) >= self.PENDING or self.pending.get(address, 0) >= self.PER_ADDRESS:
            return False
        self.pending[address] = self.pending.get(address, 0) + 1
        return True

    def done(self, address: str) -> None:
        left = self.pending.get(address, 0) - 1
        if left > 0:
            self.pending[address] = left
        else:
            self.pending.pop(address, None)

    async def check(self, address: str, password: str, password_hash: str) -> bool:
        """Whether the password is right; `address` must have been admitted."""
        if self.checker is None:
            self.checker = ThreadPoolExecutor(1, thread_name_prefix="gpubroker-sign-in")
        loop = asyncio.get_running_loop()
        checking = self.checker.submit(verify_password, password, password_hash)

        def finished(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile: nobody counts any more
                loop.call_soon_threadsafe(self.done, address)

        checking.add_done_callback(finished)
        return await asyncio.wrap_future(checking)

    def close(self) -> None:
        if self.checker is not None:
            self.checker.shutdown(wait=False, cancel_futures=True)


SIGN_INS = web.AppKey("sign_ins", SignIns)
GIB = 2**30
FIGURES = ("total", "observed", "external", "resident", "leased", "reserve", "schedulable")
EVENTS_SHOWN = 200  # newest first; older ones are in /v1/events
EVENTS_SCANNED = 2000
DETAIL_SHOWN = 120  # characters of one of an event's details shown in the list; the whole of it opens below
LEASES_SHOWN = 1000  # of this node's own: queued, then granted, then the most recently ended; the rest are in /v1/leases


def e(value: object) -> str:
    """Text or an attribute value, escaped (quotes included)."""
    return escape(str(value), quote=True)


def gib(size: int | None) -> str:
    return "unmeasured" if size is None else f"{size / GIB:.1f} GiB"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def ago(seconds: float) -> str:
    """A duration as a person reads it: "2 s", "3 min", "5 h", "2 d"."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h"
    return f"{s // 86400} d"


def moment(at: float | str | None, now: float) -> str:
    """A time as "3 min ago" or "in 5 min", with the exact RFC 3339 time on hover."""
    if at is None:
        return '<span class="muted">never</span>'
    try:
        stamp = datetime.fromisoformat(at).timestamp() if isinstance(at, str) else float(at)
        exact = rfc3339(stamp)
    except (ValueError, TypeError, OverflowError, OSError):
        return f'<span class="muted">{e(at)}</span>'  # another node's document said something that is not a time
    words = f"{ago(now - stamp)} ago" if stamp <= now else f"in {ago(stamp - now)}"
    return f'<time datetime="{exact}" title="{exact}">{words}</time>'


SIGN_IN_TO_ACT = (
    '<p class="muted">Releasing leases and changing the cluster from the browser takes a signed-in admin: '
    "set <code>ui_password_hash</code> (from <code>gpubroker password</code>) and sign in.</p>"
)


def action(method: str, url: str, label: str, show: str = "") -> str:
    """A button live.js turns into one API call (with the page's CSRF token); `show` names a field of the answer to display."""
    return (
        f'<button class="act" data-method="{e(method)}" data-url="{e(url)}"'
        + (f' data-show="{e(show)}"' if show else "")
        + f">{e(label)}</button>"
    )


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], empty: str) -> str:
    """Cells are HTML already (escape them on the way in)."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="muted">{e(empty)}</p>'
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


# ----- the cluster's GPUs, from this node's figures or another node's document ----------


def node_gpus(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU as {index, uuid, name, figures, external: [(name, bytes)], holders: [(holder, bytes)]}."""
    if node.get("self"):
        out = []
        for gpu in node.get("gpus", []):
            external = external_by_name(gpu)
            # What each lease counts here: what it declared, or what its processes use where that is more (SPEC §2).
            holders = [
                (lease.get("holder") or lease["id"], max(lease.get("bytes") or 0, lease.get("used") or 0))
                for lease in gpu.get("leases", [])
            ]
            out.append({**gpu, "external": sorted(external.items()), "holders": holders})
        return out
    document = node.get("document") or {}
    by_gpu: dict[int, list[tuple[str, int]]] = {}
    for lease in listed_leases(document, node["id"]):
        for gpu in lease["gpus"]:
            by_gpu.setdefault(gpu["index"], []).append((lease["holder"]["name"] or lease["id"], gpu["bytes"]))
    return [
        {**gpu, "external": sorted((gpu.get("external") or {}).items()), "holders": by_gpu.get(gpu.get("index"), [])}
        for gpu in document.get("gpus", [])
    ]


# A part of a bar narrower than this share of its GPU is a pixel or less, all border: drawn alone, 200 small leases
# showed as a blank stretch of the bar. Such parts of one kind are drawn as one ("200 holders").
NARROWEST = 0.01
NAMES_SHOWN = 8  # in a GPU's line of figures, by kind; the rest are counted ("and 192 more 12.0")


def segments(gpu: dict[str, Any]) -> list[tuple[str, str, int]]:
    """The bar's (kind, label, bytes): external by process name, resident, leased by holder, reserve, schedulable.

    Named parts never exceed their figure: what the names leave over is shown as its own part, and parts too
    narrow to see are drawn together.
    """
    figures = gpu["figures"]
    out: list[tuple[str, str, int]] = []
    narrowest = figures.get("total", 0) * NARROWEST

    def split(kind: str, named: list[tuple[str, int]], whole: int, rest: str, many: str) -> None:
        left = whole
        narrow: list[tuple[str, int]] = []
        for name, size in named:
            part = min(size, left)
            if part > 0:
                if part < narrowest:
                    narrow.append((name, part))
                else:
                    out.append((kind, name, part))
                left -= part
        if len(narrow) == 1:
            out.append((kind, *narrow[0]))
        elif narrow:
            out.append((kind, f"{len(narrow)} {many}", sum(size for _, size in narrow)))
        if left > 0:
            out.append((kind, rest, left))

    split("external", gpu["external"], figures.get("external", 0), "unattributed", "processes")
    if figures.get("resident", 0) > 0:
        out.append(("resident", "resident", figures["resident"]))
    split("leased", gpu["holders"], figures.get("leased", 0), "beyond declared", "holders")
    out.append(("reserve", "reserve", figures.get("reserve", 0)))
    out.append(("schedulable", "schedulable", figures.get("schedulable", 0)))
    return out


def bar(gpu: dict[str, Any]) -> str:
    parts = segments(gpu)
    whole = max(gpu["figures"].get("total", 0), sum(size for _, _, size in parts), 1)
    spans = "".join(
        f'<span class="seg seg-{kind}" style="width:{100 * size / whole:.2f}%" data-kind="{kind}" data-label="{e(label)}" '
        f'data-bytes="{size}" title="{e(label)}: {gib(size)}"></span>'
        for kind, label, size in parts
        if size > 0
    )
    return f'<div class="bar" role="img" aria-label="{e(figures_text(gpu))}">{spans}</div>'


def names_text(named: list[tuple[str, int]]) -> str:
    """Names with their GiB ("comfyui 8.0, whisper 2.0"), the NAMES_SHOWN largest only, in their order: 200 leases must
    not fill a card, nor the one that holds most of a GPU hide among the rest."""
    largest = set(sorted(range(len(named)), key=lambda i: -named[i][1])[:NAMES_SHOWN])
    shown = ", ".join(f"{name} {size / GIB:.1f}" for i, (name, size) in enumerate(named) if i in largest)
    if len(named) > NAMES_SHOWN:
        rest = [size for i, (_, size) in enumerate(named) if i not in largest]
        shown += f" and {len(rest)} more {sum(rest) / GIB:.1f}"
    return shown


def figures_text(gpu: dict[str, Any]) -> str:
    f = gpu["figures"]
    external, holders = names_text(gpu["external"]), names_text(gpu["holders"])
    words = [f"{gib(f.get('total'))} total", f"{f.get('external', 0) / GIB:.1f} external" + (f" ({external})" if external else "")]
    if f.get("resident", 0) > 0:
        words.append(f"{f['resident'] / GIB:.1f} resident")
    words += [
        f"{f.get('leased', 0) / GIB:.1f} leased" + (f" ({holders})" if holders else ""),
        f"{f.get('reserve', 0) / GIB:.1f} reserve",
        f"{f.get('schedulable', 0) / GIB:.1f} schedulable",
    ]
    return " · ".join(words)


# ----- the pages' live regions ---------------------------------------------------------


def cluster_region(request: web.Request) -> str:
    view = cluster_view(request.app)
    now = time.time()
    coordinator = (view.get("coordinator") or {}).get("id")
    totals = dict.fromkeys(("total", "external", "resident", "leased", "reserve", "schedulable"), 0)
    cards = []
    gpu_count = 0
    down = stale = 0
    missing_count = missing_bytes = 0  # leased on GPUs the driver no longer lists: in no GPU's figures
    mesh = request.app[MESH].mesh
    for node in view["nodes"]:
        gpus = node_gpus(node)
        if node.get("self"):
            missing = request.app[BROKER].missing_json()
        else:  # as its document says, on this node's clock (its leases on them are in its list of leases)
            missing = listed_missing(node.get("document") or {}, mesh.shift_of(node["id"]) if mesh is not None else 0.0)
        if node.get("self") or node.get("state") in ("alive", "suspect"):
            gpu_count += len(gpus)
            missing_count += len(missing)
            missing_bytes += sum(gpu["bytes"] for gpu in missing)
            for gpu in gpus:
                if gpu.get("stale"):  # its node refuses it (SCHEDULER_STATE_STALE): its last figures are no room to offer
                    stale += 1
                    continue
                for name in totals:
                    totals[name] += gpu["figures"].get(name, 0)
        else:
            down += 1  # its last document still shows, but nothing can be granted there: not in the totals
        name = node.get("name") or (node.get("document") or {}).get("name") or node["id"]
        badges = '<span class="badge coordinator">coordinator</span>' if node["id"] == coordinator else ""
        if node.get("self"):
            badges += '<span class="badge">this node</span>'
        age = node.get("age")
        fresh = f"seen {moment(now - age, now)}" if age is not None else '<span class="muted">no document yet</span>'
        rows = "".join(
            f'<li class="gpu" data-uuid="{e(gpu.get("uuid"))}"><div class="gpu-head"><span>{e(gpu.get("index"))} · {e(gpu.get("name"))}</span>'
            f"<code>{e(gpu.get('uuid'))}</code></div>{STALE if gpu.get('stale') else ''}{pressure_warning(gpu, by_how_much=False)}"
            f'{bar(gpu)}<p class="figures">{e(figures_text(gpu))}</p></li>'
            for gpu in gpus
        )
        problem = node.get("driver_error") or (node.get("document") or {}).get("driver_error")
        warning = f'<p class="warning">driver: {e(problem)}</p>' if problem else ""
        if node.get("self"):
            warning += unreadable_warnings({"unreadable_gpus": request.app[BROKER].unreadable_json()})
        elif not problem:  # another node's, as its document says (its leases on them are in its list of leases)
            warning += unreadable_warnings({"unreadable_gpus": listed_unreadable(node.get("document") or {})})
        warning += missing_warnings(missing, now)
        cards.append(
            f'<article class="card node state-{e(node.get("state"))}" data-node="{e(node["id"])}">'
            f'<header><h2>{e(name)}</h2>{badges}<span class="state">{e(node.get("state"))}</span><span class="fresh">{fresh}</span></header>'
            f'{warning}<ul class="gpus">{rows or "<li class=muted>no GPUs</li>"}</ul></article>'
        )
    summary = " · ".join(f"{totals[k] / GIB:.1f} GiB {k}" for k in totals if k != "resident" or totals[k])
    gone = f" ({missing_count} missing, {gib(missing_bytes)} leased on {'it' if missing_count == 1 else 'them'}, not counted)"
    return (
        f'<section class="totals"><h1>Cluster</h1><p>{plural(len(view["nodes"]), "node")}{f" ({down} down, not counted)" if down else ""}'
        f" · {plural(gpu_count, 'GPU')}{f' ({stale} stale, not counted)' if stale else ''}{gone if missing_count else ''}"
        f" · {e(summary)}</p>{legend()}</section>"
        f'<div class="cards">{"".join(cards)}</div>'
    )


# A reading too old to decide on where the GPU is (its node's verdict, in its document for another node's): its figures
# are the last known, not room; the node refuses requests for it (SCHEDULER_STATE_STALE) until it is read again.
STALE = '<p class="warning">stale: its reading is too old to decide on; no lease is granted on it until it is read again</p>'


def legend() -> str:
    kinds = ("external", "resident", "leased", "reserve", "schedulable")
    return '<p class="legend">' + "".join(f'<span><i class="seg-{k}"></i>{k}</span>' for k in kinds) + "</p>"


def pressure_warning(gpu: dict[str, Any], by_how_much: bool = True) -> str:
    """A GPU whose external usage has grown into what its leases declared or its reserve (its node's verdict, in its
    document for another node's), by how much where its leases are at hand (this node's Node page)."""
    if not gpu.get("pressure"):
        return ""
    grown = ""
    if by_how_much:
        f = gpu["figures"]
        declared = sum(lease.get("bytes") or 0 for lease in gpu.get("leases", []))
        grown = f" {gib(min(f['external'], f['external'] + f['resident'] + declared + f['reserve'] - f['total']))}"
    return (
        f'<p class="warning">external pressure: external usage has grown{grown} into leased or reserved memory; '
        "nothing is revoked, and requests it leaves no room for are refused (EXTERNAL_GPU_PRESSURE)</p>"
    )


def unreadable_warnings(node: dict[str, Any]) -> str:
    """A warning for each GPU the driver lists but cannot read: it is not offered, its leases stay."""
    return "".join(
        f'<p class="warning">GPU {e(gpu["index"])} ({e(gpu["uuid"] or "UUID unknown")}) cannot be read: {e(gpu["error"])}; '
        f"not offered until it can be read again{'; leases ' + e(', '.join(gpu['leases'])) + ' stay on it' if gpu.get('leases') else ''}</p>"
        for gpu in node.get("unreadable_gpus", [])
    )


def missing_warnings(gpus: list[dict[str, Any]], now: float) -> str:
    """A warning for each GPU that leases hold and the driver no longer lists: nothing is granted on it, its leases stay."""
    return "".join(
        f'<p class="warning">GPU {e(gpu["index"])}{" · " + e(gpu["name"]) if gpu.get("name") else ""} ({e(gpu["uuid"])}) '
        f"is no longer listed by the driver, since {moment(gpu['since'], now)}: leases {e(', '.join(gpu['leases']))}"
        f"{f' and {more} more' if (more := gpu.get('leases_not_listed')) else ''} hold {gib(gpu['bytes'])} on it "
        "and stay until released or expired; nothing is granted on it</p>"
        for gpu in gpus
    )


def node_region(request: web.Request) -> str:
    broker = request.app[BROKER]
    node = broker.node_json()
    rows = []
    for gpu in node["gpus"]:
        figures = [gib(gpu["figures"].get(name)) for name in FIGURES]
        processes = "".join(
            f"<li>{e(p['pid'])} {e(p.get('name') or 'unnamed')} · {gib(p.get('bytes'))} · "
            + (f"<code>{e(p['lease'])}</code>" if p.get("lease") else '<span class="muted">no lease</span>')
            + "</li>"
            for p in gpu.get("processes", [])
        )
        rows.append(
            [
                e(gpu["index"]),
                e(gpu["name"]) + (STALE if gpu.get("stale") else "") + pressure_warning(gpu),
                f"<code>{e(gpu['uuid'])}</code>",
                *figures,
                f'<ul class="plain">{processes}</ul>' if processes else "—",
            ]
        )
    cpu, memory = node.get("cpu", {}), node.get("memory", {})
    budgets = table(
        ("budget", "total", "leased", "schedulable"),
        [
            ["CPU cores", e(cpu.get("cores")), e(cpu.get("leased")), e(cpu.get("schedulable"))],
            ["host memory", gib(memory.get("total")), gib(memory.get("leased")), gib(memory.get("schedulable"))],
        ],
        "no budgets",
    )
    error = f'<p class="warning">driver: {e(node["driver_error"])}</p>' if node.get("driver_error") else ""
    error += unreadable_warnings(node) + missing_warnings(node["missing_gpus"], time.time())
    queue = ", ".join(f"{e(k)} {e(v)}" for k, v in node.get("queue", {}).items())
    return (
        f'<h1>Node {e(node["node"]["name"])}</h1><p class="muted"><code>{e(node["node"]["id"])}</code> · '
        f"gpubroker {e(node['node']['version'])} · queue: {queue}</p>{error}"
        f"<h2>GPUs</h2>{table(('#', 'name', 'UUID', *FIGURES, 'processes'), rows, 'no GPUs')}<h2>CPU and memory</h2>{budgets}"
    )


def lease_rows(
    request: web.Request, state: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]], list[tuple[str, str]]]:
    """One row per lease across the cluster (this node's own list, the others' documents), each node's queue, and
    by node what is not listed (as HTML): a page that cuts leases must say so."""
    broker = request.app[BROKER]
    view = cluster_view(request.app)
    rows: list[dict[str, Any]] = []
    queues: dict[str, dict[str, int]] = {}
    cut: list[tuple[str, str]] = []
    for node in view["nodes"]:
        name = node.get("name") or (node.get("document") or {}).get("name") or node["id"]
        if node.get("self"):
            queues[name] = dict(node.get("queue", {}))
            missing = {gpu["uuid"] for gpu in broker.missing_json()}
            own = broker.list_leases(state, LEASES_SHOWN + 1)  # one more than shown: whether there are more
            if len(own) > LEASES_SHOWN:
                del own[LEASES_SHOWN:]
                which = f" {e(state)}" if state else ""
                cut.append(
                    (
                        name,
                        f"{e(name)} has more than {LEASES_SHOWN}{which} leases: the first {LEASES_SHOWN} are shown"
                        + ("" if state else " (queued, then granted, then the most recently ended)")
                        + "; <code>gpubroker leases --limit N</code> on it (or <code>GET /v1/leases?limit=N</code>) lists more",
                    )
                )
            for lease in own:
                queued = lease["state"] == "queued"
                if queued:  # no GPU is chosen yet: what it asks for, and its place in the queue and why
                    asked = lease["request"]
                    # An exclusive request asks for whole GPUs, whatever their size: its gpu_memory is only their least.
                    gpus, held = _asked(asked), None if asked["exclusive"] else asked["gpu_memory"] * asked["gpus"]
                else:
                    gpus = _indexes(lease.get("gpus", []), missing if lease["state"] == "granted" else set())
                    held = sum(g["bytes"] for g in lease.get("gpus", []))
                rows.append(
                    {
                        "id": lease["id"],
                        "holder": lease["holder"].get("name"),
                        "node": name,
                        "gpus": gpus,
                        "bytes": held,
                        "waits": f"position {lease['position']}: {lease['reason']}" if queued else None,
                        "priority": lease["priority"],
                        "preemption": lease["preemption"],
                        "since": lease["queued_at"] if queued else lease["granted_at"],
                        "expires": lease["expires_at"] if lease["state"] == "granted" else None,  # an ended one has no expiry ahead
                        "state": lease["state"],
                        "labels": lease.get("labels") or {},
                    }
                )
            continue
        document = node.get("document") or {}
        queues[name] = dict(document.get("queue", {}))
        mesh = request.app[MESH].mesh  # another node's times are read on this node's clock: the two may disagree
        listed = listed_leases(document, node["id"], mesh.shift_of(node["id"]) if mesh is not None else 0.0)
        missing = {gpu["uuid"] for gpu in listed_missing(document)}
        more = document.get("leases_not_listed")
        if isinstance(more, int) and more > 0:  # its document had no room for them (LEASES_ROOM): only its node knows them
            cut.append(
                (
                    name,
                    f"{e(name)} lists {len(listed)} of its {len(listed) + more} granted leases in its document; "
                    f"<code>gpubroker leases</code> on {e(name)} (or <code>GET /v1/leases</code> there) lists them all",
                )
            )
        # A node that is down shows its leases as its last document listed them: granted then, not known now.
        down = None if node.get("state") in ("alive", "suspect") else str(node.get("state") or "down")
        for listed_one in listed:
            rows.append(
                {
                    "id": listed_one["id"],
                    "holder": listed_one["holder"]["name"],
                    "node": name,
                    "gpus": _indexes(listed_one["gpus"], missing),
                    "bytes": sum(g["bytes"] for g in listed_one["gpus"]),
                    "priority": listed_one["priority"],
                    "preemption": listed_one["preemption"],
                    "since": listed_one["granted_at"],
                    "expires": listed_one["expires_at"],
                    "state": "granted",
                    "labels": listed_one["labels"],  # as many as its document lists (LABELS_ROOM)
                    "node_down": down,
                }
            )
    return rows, queues, cut


def _asked(request: dict[str, Any]) -> str:
    """The GPUs a waiting request waits for: the one it is pinned to, or any of them."""
    if not request["gpus"]:
        return ""
    return str(request["gpu"]) if request["gpu"] is not None else f"any {request['gpus']}"


def _indexes(gpus: list[dict[str, Any]], missing: set[str]) -> str:
    """A lease's GPUs by index, a card its driver no longer lists marked so (its memory is in no GPU's figures)."""
    return ", ".join(f"{g['index']}{' (no longer listed)' if g.get('uuid') in missing else ''}" for g in gpus)


def _labels(labels: dict[str, str]) -> str:
    """A lease's labels (SPEC §3.1: free-form key/values shown in the UI), under its holder."""
    if not labels:
        return ""
    shown = " ".join(f'<span class="label">{e(key)}={e(value)}</span>' for key, value in sorted(labels.items()))
    return f'<br><span class="labels muted">{shown}</span>'


def leases_region(request: web.Request) -> str:
    now = time.time()
    admin = is_admin(request)
    state = request.query.get("state", "")
    rows, queues, cut = lease_rows(request, state or None)
    node = request.query.get("node", "")
    shown = [r for r in rows if (not state or r["state"] == state) and (not node or r["node"] == node)]
    states = STATES  # the rows are of one state where one is asked for
    options = "".join(f'<option value="{e(s)}"{" selected" if s == state else ""}>{e(s)}</option>' for s in states)
    nodes = "".join(f'<option value="{e(n)}"{" selected" if n == node else ""}>{e(n)}</option>' for n in queues)
    form = (
        '<form class="filters" method="get" action="/leases"><label>state <select name="state"><option value="">any</option>'
        f'{options}</select></label><label>node <select name="node"><option value="">any</option>{nodes}</select></label>'
        "<button>filter</button></form>"
    )
    cells = [
        [
            f'<span class="holder">{e(r["holder"] or "—")}</span>' + _labels(r["labels"]),
            f'<span class="node-name">{e(r["node"])}</span>',
            e(r["gpus"] or "—"),
            "whole" if r["bytes"] is None else gib(r["bytes"]),
            e(r["priority"]),
            e(r["preemption"] or "—"),
            moment(r["since"], now) if r["since"] else "—",
            moment(r["expires"], now) if r["expires"] else "—",
            f'<span class="state state-{e(r["state"])}">{e(r["state"])}</span>'
            + (f'<br><span class="muted">as last seen: {e(r["node"])} is {e(r["node_down"])}</span>' if r.get("node_down") else "")
            + (f'<br><span class="muted waits">{e(r["waits"])}</span>' if r.get("waits") else ""),
            f'<code class="lease-id">{e(r["id"])}</code>',
            *(
                [
                    action("DELETE", f"/v1/leases/{quote(str(r['id']), safe='')}", "release" if r["state"] == "granted" else "cancel")
                    if r["state"] in ("granted", "queued")
                    else ""  # an ended lease has nothing left to release
                ]
                if admin
                else []
            ),
        ]
        for r in shown
    ]
    classes = sorted({c for q in queues.values() for c in q})
    queue_rows = [[e(name), *(e(q.get(c, 0)) for c in classes)] for name, q in queues.items()]
    headers = ("holder", "node", "GPU", "bytes", "class", "preemption", "age", "expiry", "state", "id", *([""] if admin else []))
    return (
        f"<h1>Leases</h1>{form}"
        + ("" if admin else SIGN_IN_TO_ACT)
        + table(headers, cells, "no leases")
        + "".join(f'<p class="muted">{note}</p>' for of, note in cut if not node or of == node)
        + "<h2>Queue per class</h2>"
        + table(("node", *classes), queue_rows, "no queue")
    )


def _in_bytes(key: str, details: dict[str, Any]) -> bool:
    """Whether an event's detail `key` is an amount of memory: one named so, or a refusal's need (of GPU memory, or of
    host memory with its figures), not the count of CPU cores a host refusal names in the same words."""
    if key in ("bytes", "declared", "observed") or key.endswith("_bytes"):
        return True
    if details.get("resource") == "host memory":
        return key in ("need", "total", "leased", "schedulable")
    return key == "need" and "need_gpus" in details


def _detail_text(key: str, value: Any, details: dict[str, Any]) -> tuple[str, str]:
    """One of an event's details as a person reads it, and its exact value where that text rounds it: memory in GiB
    as the other pages show it (a GPU's `figures` too), a nested value as compact JSON, text as it is."""
    if isinstance(value, int) and not isinstance(value, bool) and _in_bytes(key, details):
        return gib(value), f"{value} bytes"
    if isinstance(value, list) and value and all(type(v) is int for v in value) and _in_bytes(key, details):
        return ", ".join(gib(v) for v in value), ", ".join(f"{v} bytes" for v in value)
    if key == "figures" and value and isinstance(value, dict) and all(type(v) is int for v in value.values()):
        (name, first), *rest = value.items()  # as a GPU's card gives its figures: GiB said once, each figure named
        text = " · ".join([f"{gib(first)} {name}", *(f"{v / GIB:.1f} {other}" for other, v in rest)])
        return text, ", ".join(f"{other} {v} bytes" for other, v in value.items())
    if isinstance(value, str):
        return value, ""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str), ""


def event_details(details: dict[str, Any]) -> str:
    """An event's details as `key: value`, each escaped; one longer than DETAIL_SHOWN is cut, the whole of it a
    click away (a refusal names every GPU it considered, with their leases)."""
    shown = []
    for key, value in details.items():
        text, exact = _detail_text(str(key), value, details)
        title = f' title="{e(exact)}"' if exact else ""
        if len(text) <= DETAIL_SHOWN:
            shown.append(f"<code{title}>{e(key)}: {e(text)}</code>")
        else:
            shown.append(
                f"<details><summary><code>{e(key)}: {e(text[:DETAIL_SHOWN])}…</code></summary><code{title}>{e(text)}</code></details>"
            )
    return " ".join(shown)


def events_region(request: web.Request) -> str:
    broker = request.app[BROKER]
    now = time.time()
    code = request.query.get("code", "")
    newest = broker.last_event_seq
    found, _ = broker.events(max(0, newest - EVENTS_SCANNED), EVENTS_SCANNED)
    matching = [event for event in reversed(found) if not code or event.get("code") == code]
    shown = matching[:EVENTS_SHOWN]
    options = "".join(f'<option value="{c.value}"{" selected" if c.value == code else ""}>{c.value}</option>' for c in FailureCode)
    form = (
        '<form class="filters" method="get" action="/events"><label>code <select name="code"><option value="">any</option>'
        f"{options}</select></label><button>filter</button></form>"
    )
    items = []
    for event in shown:
        details = event_details(event.get("details") or {})
        items.append(
            f'<li class="event" data-seq="{e(event["seq"])}" data-type="{e(event["type"])}" data-code="{e(event.get("code", ""))}">'
            f'<span class="when">{moment(event["time"], now)}</span> <strong>{e(event["type"])}</strong>'
            + (f' <span class="badge">{e(event["code"])}</span>' if event.get("code") else "")
            + f'<p>{e(event["message"])}</p><div class="details">{details}</div></li>'
        )
    # A burst of more than the page shows, or a code older than those looked at, must not pass for all there is.
    cut = len(found) == EVENTS_SCANNED  # older events may be kept beyond those looked at
    with_code = f" with code {e(code)}" if code else ""
    rest = "; <code>gpubroker events</code> (or <code>GET /v1/events</code>) lists every one kept"
    if not items:
        body = f'<p class="muted">no events{with_code}' + (f" among the newest {EVENTS_SCANNED}{rest}" if cut and code else "") + "</p>"
    else:
        body = f'<ol class="events">{"".join(items)}</ol>'
        if len(matching) > len(shown):
            body += f'<p class="muted">the newest {len(shown)} events{with_code} are shown{rest}</p>'
        elif cut and code:
            body += f'<p class="muted">{plural(len(shown), "event")}{with_code} among the newest {EVENTS_SCANNED}{rest}</p>'
    return f"<h1>Events</h1>{form}{body}"


def mesh_region(request: web.Request) -> str:
    mesh = request.app[MESH].mesh
    if mesh is None:
        return (
            '<h1>Mesh</h1><p class="muted">This node belongs to no cluster: it is a cluster of one. '
            "Run <code>gpubroker init</code> to start a cluster, or <code>gpubroker up --join TOKEN</code> to join one.</p>"
        )
    now = time.time()
    admin = is_admin(request)
    view = cluster_view(request.app)
    nodes = mesh.nodes_json()
    by_id = {node["id"]: node for node in view["nodes"]}
    coordinator = view.get("coordinator") or {}
    rows = []
    for member in nodes["members"]:
        seen = by_id.get(member["id"], {})
        age = seen.get("age")
        rows.append(
            [
                e(member["name"])
                + (' <span class="badge coordinator">coordinator</span>' if member["id"] == coordinator.get("id") else ""),
                f"<code>{e(member['id'])}</code>",
                f'<span class="state state-{e(seen.get("state") or member["state"])}">{e(seen.get("state") or member["state"])}</span>',
                e(seen.get("incarnation", "—")),
                e(seen.get("addr", "—")),
                moment(now - age, now) if age is not None else "—",
                *(
                    [action("DELETE", f"/v1/cluster/nodes/{quote(str(member['id']), safe='')}", "remove") if not seen.get("self") else ""]
                    if admin
                    else []
                ),
            ]
        )
    pending = [
        [
            e(p["name"]),
            f"<code>{e(p['id'])}</code>",
            e(p["addr"]),
            f"<code>{e(p['fingerprint'])}</code>",
            *([action("POST", f"/v1/cluster/nodes/{quote(str(p['id']), safe='')}/approve", "approve")] if admin else []),
        ]
        for p in nodes["pending"]
    ]
    epoch = coordinator.get("epoch", "—")
    invite = (
        '<p class="actions">' + action("POST", "/v1/cluster/invites", "invite a node", show="token") + " prints a one-time join token: "
        "run <code>gpubroker up --join TOKEN</code> on the new node</p>"
        if admin
        else SIGN_IN_TO_ACT
    )
    return (
        f"<h1>Mesh</h1><p>coordinator <code>{e(coordinator.get('id', 'none'))}</code> · epoch {e(epoch)} · "
        f"{len(nodes['removed'])} removed</p>{invite}"
        + table(("name", "id", "state", "incarnation", "address", "document", *([""] if admin else [])), rows, "no members")
        + "<h2>Pending nodes</h2>"
        + table(
            ("name", "id", "address", "fingerprint", *([""] if admin else [])),
            pending,
            "none waiting; approve one with `gpubroker nodes approve ID`",
        )
    )


# ----- the shell and the routes --------------------------------------------------------

Region = Callable[[web.Request], str]
PAGES: dict[str, tuple[str, str, Region]] = {
    "cluster": ("/", "Cluster", cluster_region),
    "node": ("/node", "Node", node_region),
    "leases": ("/leases", "Leases", leases_region),
    "events": ("/events", "Events", events_region),
    "mesh": ("/mesh", "Mesh", mesh_region),
}


def is_admin(request: web.Request) -> bool:
    """Whether this page's reader may act on any lease and on the cluster (signed in, or root on the socket)."""
    caller = request.get(CALLER)
    return caller is not None and caller.admin is not None


def shell(request: web.Request, page: str, region: str) -> str:
    path, title, _ = PAGES[page]
    nav = "".join(
        f'<a href="{p}"' + (' aria-current="page"' if name == page else "") + f">{label}</a>" for name, (p, label, _) in PAGES.items()
    )
    node = request.app[BROKER].config.name
    session = request.get(SESSION)
    csrf = f'<meta name="csrf-token" content="{e(session.csrf)}">' if session is not None else ""
    sign_out = (
        f'<form class="sign-out" method="post" action="/logout"><input type="hidden" name="{CSRF_FIELD}" value="{e(session.csrf)}">'
        "<button>sign out</button></form>"
        if session is not None
        else ""
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{csrf}'
        f"<title>{e(title)} · {e(node)} · gpubroker</title>"
        '<link rel="stylesheet" href="/static/style.css"><script src="/static/live.js" defer></script></head>'
        f'<body data-events="{" ".join(EVENT_TYPES)}"><header class="top"><a class="brand" href="/">gpubroker</a>'
        f'<span class="muted">{e(node)}</span><nav>{nav}</nav><span id="live-state" class="live-state" title="live updates">offline</span>'
        f'{sign_out}</header><p id="notice" class="notice" role="status" hidden></p>'
        f'<main id="live" data-fragment="/fragment/{page}">{region}</main></body></html>'
    )


# ----- signing in -------------------------------------------------------------------------


def _local_path(target: str | None) -> str:
    """Where to go after signing in: a path of this broker, never another site (browsers drop tabs and newlines,
    and read a backslash as a slash, so any of them could turn "/" + "/evil.example" into another site)."""
    if not target or not target.isprintable() or "\\" in target:
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return "/"
    return target


def login_page(request: web.Request, status: int = 200, message: str = "", target: str | None = None) -> web.Response:
    """The sign-in form; `target` is where a refused sign-in meant to go (else the page asked for, or `next`)."""
    node = request.app[BROKER].config.name
    target = _local_path(target or request.query.get("next") or (request.path_qs if request.path != "/login" else "/"))
    warning = f'<p class="error" role="alert">{e(message)}</p>' if message else ""
    form = (
        f'<form method="post" action="/login"><input type="hidden" name="next" value="{e(target)}">'
        '<label>password <input type="password" name="password" autocomplete="current-password" autofocus required></label>'
        "<button>sign in</button></form>"
        '<p class="muted">The password is the one whose hash is this node\'s <code>ui_password_hash</code> setting.</p>'
    )
    if not request.app[GUARD].required:  # nobody signs in where there is no password to know
        form = (
            '<p class="muted">This node has no UI password, so there is nothing to sign in to: its pages are open '
            f'on its listen address (<a href="{e(target)}">go on</a>), and changes are made as root on its Unix socket. '
            "<code>gpubroker password</code> makes a <code>ui_password_hash</code> for the config file.</p>"
        )
    body = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<title>Sign in · {e(node)} · gpubroker</title><link rel="stylesheet" href="/static/style.css"></head>'
        f'<body><main class="login"><h1>gpubroker · {e(node)}</h1>{warning}{form}'
        "</main></body></html>"
    )
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"})


async def login_form(request: web.Request) -> web.Response:
    if request.app[GUARD].sessions.get(request.cookies.get(SESSION_COOKIE)) is not None:
        raise web.HTTPSeeOther(_local_path(request.query.get("next")))
    return login_page(request)


async def login(request: web.Request) -> web.Response:
    guard = request.app[GUARD]
    form = await read_form(request)
    password, asked = form.get("password"), form.get("next")
    target = asked if isinstance(asked, str) else None  # kept through a refusal: the next try still lands there
    if guard.password_hash is None:
        return login_page(request, 403, "this node has no UI password (ui_password_hash): there is nothing to sign in to")
    sign_ins, address = request.app[SIGN_INS], SignIns.source(request.remote)
    if not isinstance(password, str):
        right = False
    elif sign_ins.admit(address):
        right = await sign_ins.check(address, password, guard.password_hash)
    else:
        _sign_in_refused(request, "too many at once")
        answer = login_page(request, 429, "too many sign-in attempts at once; try again in a few seconds", target)
        answer.headers["Retry-After"] = "2"
        return answer
    if not right:
        _sign_in_refused(request, "wrong password")
        await asyncio.sleep(0.2)
        return login_page(request, 401, "wrong password", target)
    session = guard.sessions.create()
    answer = web.HTTPSeeOther(_local_path(target))
    answer.set_cookie(SESSION_COOKIE, session.id, httponly=True, samesite="Strict", secure=guard.tls, path="/")
    request.app[BROKER].record_event("ui.signed_in", f"someone signed in to the web UI of {request.app[CONFIG].name}", details={})
    raise answer


def _sign_in_refused(request: web.Request, why: str) -> None:
    """A refused sign-in is kept as an event, within the rate every refusal's event is kept at (SPEC §3.6)."""
    broker = request.app[BROKER]
    details = broker.refusals.keep({"reason": why, "path": "/login"})
    if details is not None:
        broker.record_event(
            "ui.sign_in.refused",
            f"a sign-in to the web UI of {broker.config.name} was refused: {why}",
            code=FailureCode.UNAUTHORIZED,
            details=details,
        )


async def logout(request: web.Request) -> web.Response:
    request.app[GUARD].sessions.drop(request.cookies.get(SESSION_COOKIE))
    answer = web.HTTPSeeOther("/login")
    answer.del_cookie(SESSION_COOKIE, path="/")
    raise answer


def _page(page: str) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.Response:
        # Never kept by the browser: after signing out, Back must ask again (and get the sign-in form), not show the
        # signed-in page with its CSRF token and release buttons from the cache.
        text = shell(request, page, PAGES[page][2](request))
        return web.Response(text=text, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"})

    return handler


async def fragment(request: web.Request) -> web.Response:
    page = PAGES.get(request.match_info["page"])
    if page is None:
        raise NotFound(f"no such page: {request.match_info['page']}", {"page": request.match_info["page"]})
    return web.Response(text=page[2](request), content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"})


STATIC_FILES = {path.name: path for path in STATIC.iterdir() if path.is_file()}  # the pages' stylesheet and script


async def static(request: web.Request) -> web.StreamResponse:
    """The pages' own files, by name: anything else is NOT_FOUND in the one error shape."""
    path = STATIC_FILES.get(request.match_info["name"])
    if path is None:
        raise NotFound(f"no such file: {request.path}", {"path": request.path})
    return web.FileResponse(path)


def add_routes(app: web.Application) -> None:
    for name, (path, _, _) in PAGES.items():
        app.router.add_get(path, _page(name))
    app.router.add_get("/fragment/{page}", fragment)
    app[SIGN_INS] = SignIns()

    async def stop_checking(app: web.Application) -> None:
        app[SIGN_INS].close()

    app.on_cleanup.append(stop_checking)
    app.router.add_get("/login", login_form)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/static/{name}", static)
