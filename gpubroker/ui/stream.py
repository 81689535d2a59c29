"""Server-Sent Events at /v1/stream: each broker event as it is recorded, and the mesh's view when it changes.

A stream resumes after `Last-Event-ID` (or `?after=`), says `: heartbeat` when it has
been quiet for HEARTBEAT_EVERY, sends a `cluster` message (no id) when the view
changes, and a `dropped` message (no id) before events that follow a gap of events no
longer kept. The browser never polls: the server looks at in-memory state on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gpubroker.broker.lease import ENDED
from gpubroker.errors import FailureCode, InvalidRequest, Refusal
from gpubroker.ui.api import BROKER, GUARD, SESSION, cluster_view

HEARTBEAT_EVERY = 15.0  # seconds of quiet before a comment line; proxies drop idle connections
POLL_EVERY = 0.2  # how often a stream compares the broker's newest event seq (an int in memory) with its own
CLUSTER_EVERY = 1.0  # the mesh's view is looked at no more often than this
MAX_STREAMS = 32  # each browser holds one (its tabs share it); more than this is a leak somewhere
REPLAY_BATCH = 500

# Every type the broker and the mesh record; the pages name them so live.js can listen for each
# (EventSource dispatches a named event only to a listener for that name).
EVENT_TYPES = (
    "broker.started",
    "gpu.driver_error",
    "gpu.driver_ok",
    "gpu.found",
    "gpu.memory_not_reclaimed",
    "gpu.missing",
    "gpu.pressure.started",
    "gpu.pressure.ended",
    "gpu.readable",
    "gpu.unreadable",
    "lease.queued",
    "lease.granted",
    "lease.refused",
    "lease.cancelled",
    "lease.over_declared",
    "lease.groups_dropped",
    "lease.work_stopped",
    *(f"lease.{state}" for state in ENDED),
    "mesh.ask",
    "mesh.coordinator",
    "mesh.invite",
    "mesh.join.admitted",
    "mesh.join.approved",
    "mesh.join.refused",
    "mesh.keys",
    "mesh.member.alive",
    "mesh.member.dead",
    "mesh.member.joined",
    "mesh.member.left",
    "mesh.member.removed",
    "mesh.node.pending",
    "mesh.removed",
    "request.refused",
    "ui.sign_in.refused",
    "ui.signed_in",
    "cluster",
    "dropped",
)


@dataclass(slots=True)
class Streams:
    """The open streams of one app, and the signal that ends them all when the server shuts down."""

    open: int = 0
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    transports: set[asyncio.Transport] = field(default_factory=set)  # the open streams' connections


STREAMS = web.AppKey("streams", Streams)


def _seq(value: str, name: str) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) > 2**62:
        raise InvalidRequest(f"{name} must be an event seq, an integer from 0 to {2**62}, not {value!r}", {"field": name})
    return int(value)


def _resume_point(request: web.Request) -> int:
    """After Last-Event-ID (a reconnecting browser sends it), else ?after=, else only what comes next. A point past the
    newest event was reached on another store (the broker started again on a new or wiped one, whose events are
    numbered from 1 again), so this store's are sent from the first, as `events --follow` does."""
    newest = request.app[BROKER].last_event_seq
    header = request.headers.get("Last-Event-ID")
    after = request.query.get("after")
    if header is not None:
        point = _seq(header.strip(), "Last-Event-ID")
    elif after is not None:
        point = _seq(after, "after")
    else:
        return newest
    return point if point <= newest else 0


def message(data: dict[str, Any], event: str, seq: int | None = None) -> bytes:
    """One SSE message; JSON has no raw newlines, so `data` is one line."""
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def cluster_summary(view: dict[str, Any]) -> dict[str, Any]:
    """What a page shows of the view, without ages: it changes when a node, its state or its figures do."""
    nodes = []
    for node in view["nodes"]:
        entry: dict[str, Any] = {"id": node["id"], "name": node.get("name"), "state": node.get("state")}
        if "incarnation" in node:
            entry["incarnation"] = node["incarnation"]
        if node.get("self"):
            entry["gpus"] = [gpu["figures"] for gpu in node.get("gpus", [])]
            entry["queue"] = node.get("queue")
        elif "document" in node:
            entry["document"] = [node["document"].get("generation"), node["document"].get("version")]
        nodes.append(entry)
    return {"nodes": nodes, "coordinator": view.get("coordinator")}


async def stream(request: web.Request) -> web.StreamResponse:
    broker = request.app[BROKER]
    streams = request.app[STREAMS]
    after = _resume_point(request)
    if streams.open >= MAX_STREAMS:
        raise Refusal(
            FailureCode.QUEUE_FULL,
            f"{streams.open} event streams are open, the most this broker serves (MAX_STREAMS {MAX_STREAMS}); "
            "a browser needs one for all its tabs: close the streams of other clients",
            {"open": streams.open, "limit": MAX_STREAMS},
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    streams.open += 1
    loop = asyncio.get_running_loop()
    transport = request.transport
    try:
        await response.prepare(request)
        if transport is not None:
            streams.transports.add(transport)
        _give_up_on_silence(request)
        await response.write(b"retry: 2000\n: connected\n\n")
        last_write = loop.time()
        last_look = -CLUSTER_EVERY
        seen: str | None = None
        session = request.get(SESSION)
        while not streams.closing.is_set():
            if request.transport is None or request.transport.is_closing():
                break  # the browser went away between two writes
            if session is not None and request.app[GUARD].sessions.get(session.id) is None:
                break  # signed out, or the session expired: what it opened ends with it
            now = loop.time()
            out: list[bytes] = []
            found: list[dict[str, Any]] = []
            if broker.last_event_seq > after:
                found, next_seq = broker.events(after, REPLAY_BATCH)  # nothing yet when the event is still on its way to disk
                if dropped := broker.dropped(after, found):  # said, as /v1/events says
                    out.append(message({"dropped": dropped, "after": after, "next": found[0]["seq"]}, "dropped"))
                after = next_seq
                out += [message(event, str(event["type"]), event["seq"]) for event in found]
            if now - last_look >= CLUSTER_EVERY:
                last_look = now
                summary = cluster_summary(cluster_view(request.app))
                key = json.dumps(summary, sort_keys=True)
                if seen is not None and key != seen:
                    out.append(message(summary, "cluster"))
                seen = key
            if not out and now - last_write >= HEARTBEAT_EVERY:
                out.append(b": heartbeat\n\n")
            if out:
                try:
                    async with asyncio.timeout(2 * HEARTBEAT_EVERY):
                        await response.write(b"".join(out))
                except TimeoutError:
                    # A client that reads nothing: TCP gives up on it as long (_give_up_on_silence), the Unix socket never
                    # would, and its slot would be held for as long as the program that opened it lives.
                    if transport is not None:
                        transport.abort()
                    break
                last_write = now
            if len(found) == REPLAY_BATCH:
                continue  # more to replay: no pause
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(POLL_EVERY, HEARTBEAT_EVERY)):
                    await streams.closing.wait()
    except ConnectionError:
        pass  # the browser went away; its slot is free again below
    finally:
        streams.open -= 1
        if transport is not None:
            streams.transports.discard(transport)  # request.transport is None once the connection is gone
    return response


def _give_up_on_silence(request: web.Request) -> None:
    """A client that vanished without closing (a laptop asleep, a phone off the Wi-Fi) must not hold its stream's
    slot while the kernel retries for a quarter of an hour: over TCP, the connection ends once what was sent (a
    heartbeat, at least) has gone unacknowledged for two heartbeats."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(2 * HEARTBEAT_EVERY * 1000))


async def close_streams(app: web.Application) -> None:
    """On shutdown: end every stream at once, or the server would wait for them (60 s by default). A stream whose
    client reads nothing waits to write and never sees the signal: its connection is cut, what it holds unsent with it."""
    streams = app[STREAMS]
    streams.closing.set()
    for transport in list(streams.transports):
        if transport.get_write_buffer_size() > 0:
            transport.abort()
