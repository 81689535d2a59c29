"""The OpenAPI document served at /openapi.json: the truth the tests fuzz."""

from __future__ import annotations

from typing import Any

from gpubroker import __version__
from gpubroker.broker.request import BINDS, MAX_CORES, MAX_GPUS, MAX_LABELS, MAX_PID, MAX_TEXT, PREEMPTIONS
from gpubroker.config import CLASSES
from gpubroker.errors import FailureCode

_SIZE = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]{1,30}( ?B?|(\.[0-9]{1,30})? ?[KMGT]i?B)$"}]}
_DURATION = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]{1,30}(\.[0-9]{1,30})? ?(ms|s|m|h)?$"}]}
# A lifetime is at least 1s: as an integer, that is its minimum (a string under 1s is refused too, which no pattern says).
_TTL = {"oneOf": [{"type": "integer", "minimum": 1}, _DURATION["oneOf"][1]]}
_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_TOKEN = {"name": "X-Lease-Token", "in": "header", "required": False, "schema": {"type": "string"}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_responses(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "a typed failure", "content": {"application/json": {"schema": _ref("Error")}}} for s in statuses}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_UNREADABLE: dict[str, Any] = {  # a GPU the driver lists but cannot read
    "index": {"type": "integer", "minimum": 0, "description": "its place among the node's GPUs, which the others keep"},
    "uuid": {"type": "string", "nullable": True, "description": "null when not even its handle could be had"},
    "error": {"type": "string", "description": "the driver's error, naming the function and the GPU"},
}
_MISSING: dict[str, Any] = {  # a GPU that leases hold and the driver no longer lists
    "index": {"type": "integer", "minimum": 0, "description": "its place among the node's GPUs when last listed (or granted)"},
    "uuid": {"type": "string"},
    "name": {"type": "string", "nullable": True, "description": "as last listed; null when not listed since the broker started"},
    "since": {"type": "string", "description": "when the broker found it missing (RFC 3339; a restart finds it anew)"},
    "bytes": {"type": "integer", "minimum": 0, "description": "what the leases on it declared there"},
}
_LEASE_ANSWER = {"type": "object", "required": ["lease"], "properties": {"lease": _ref("Lease")}}

OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "gpubroker", "version": __version__, "description": "Leases on GPU memory, whole GPUs, CPU cores and host memory."},
    "paths": {
        "/v1/leases": {
            "post": {
                "operationId": "requestLease",
                "summary": "request a lease; blocks up to `wait`",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("LeaseRequest")}}},
                "responses": {"201": _json(_LEASE_ANSWER, "granted"), **_error_responses(400, 403, 409, 413, 429, 503, 507)},
            },
            "get": {
                "operationId": "listLeases",
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["queued", "granted", "released", "expired", "revoked"]},
                    },
                    {
                        "name": "node",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "a node of the cluster by id or name; empty: this one",
                    },
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100000, "default": 1000}},
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["leases"],
                            "properties": {"leases": {"type": "array", "items": _ref("Lease")}},
                        },
                        "leases",
                    ),
                    **_error_responses(400, 404),
                },
            },
        },
        "/v1/leases/{id}": {
            "get": {
                "operationId": "getLease",
                "parameters": [_ID],
                "responses": {"200": _json(_LEASE_ANSWER, "one lease or waiting request"), **_error_responses(404)},
            },
            "delete": {
                "operationId": "releaseLease",
                "summary": "release a lease (its Unix user, root, or its token)",
                "parameters": [_ID, _TOKEN],
                # 504: another node's lease, whose node did not answer the forwarded release.
                "responses": {"200": _json(_LEASE_ANSWER, "released"), **_error_responses(403, 404, 409, 504, 507)},
            },
        },
        "/v1/leases/{id}/renew": {
            "post": {
                "operationId": "renewLease",
                "summary": (
                    "extend a granted lease: it now expires `ttl` from now, the ttl given here (which the lease keeps for its "
                    "next renewals, shorter or longer) or else its own (its Unix user, root, or its token)"
                ),
                "parameters": [_ID, _TOKEN],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {"schema": {"type": "object", "additionalProperties": False, "properties": {"ttl": _TTL}}}
                    },
                },
                "responses": {"200": _json(_LEASE_ANSWER, "renewed"), **_error_responses(400, 403, 404, 409, 413, 507)},
            }
        },
        "/v1/leases/{id}/processes": {
            "post": {
                "operationId": "registerProcessGroup",
                "summary": "register a process group with the lease: its memory is the lease's, and it is signalled when the lease ends",
                "parameters": [_ID, _TOKEN],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["pgid"],
                                "additionalProperties": False,
                                "properties": {"pgid": {"type": "integer", "minimum": 2, "maximum": MAX_PID}},
                            }
                        }
                    },
                },
                "responses": {"200": _json(_LEASE_ANSWER, "registered"), **_error_responses(400, 403, 404, 409, 413, 507)},
            }
        },
        "/v1/node": {"get": {"operationId": "getNode", "responses": {"200": _json(_ref("Node"), "this node")}}},
        "/v1/cluster": {
            "get": {
                "operationId": "getCluster",
                "responses": {"200": _json({"type": "object", "required": ["nodes"]}, "every node the mesh knows")},
            }
        },
        "/v1/cluster/invites": {
            "post": {
                "operationId": "createInvite",
                "summary": "a one-time join token naming this node as the seed (root or the broker's user, on the socket)",
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {"schema": {"type": "object", "additionalProperties": False, "properties": {"ttl": _TTL}}}
                    },
                },
                "responses": {
                    "201": _json({"type": "object", "required": ["token"], "properties": {"token": {"type": "string"}}}, "a token"),
                    **_error_responses(400, 403, 409, 413),
                },
            }
        },
        "/v1/cluster/nodes": {
            "get": {
                "operationId": "listNodes",
                "responses": {
                    "200": _json({"type": "object", "required": ["members", "pending", "removed"]}, "the cluster's members"),
                    **_error_responses(409),
                },
            }
        },
        "/v1/cluster/nodes/{id}": {
            "delete": {
                "operationId": "removeNode",
                "summary": "remove a member: its certificate is refused from its next connection on",
                "parameters": [_ID],
                "responses": {
                    "200": _json({"type": "object", "required": ["members"]}, "the members left"),
                    **_error_responses(403, 404, 409),
                },
            }
        },
        "/v1/cluster/nodes/{id}/approve": {
            "post": {
                "operationId": "approveNode",
                "summary": "admit a node that asked to join (found by mDNS or given this node as a peer)",
                "parameters": [_ID],
                "responses": {"200": _json({"type": "object", "required": ["members"]}, "the members"), **_error_responses(403, 404, 409)},
            }
        },
        "/v1/cluster/keys": {
            "get": {
                "operationId": "listKeys",
                "responses": {
                    "200": _json({"type": "object", "required": ["keys"]}, "the keyring's key ids"),
                    **_error_responses(403, 409),
                },
            },
            "post": {
                "operationId": "changeKeys",
                "summary": "install a key (null: a new one), use one to seal, or remove one",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "minProperties": 1,
                                "maxProperties": 1,
                                "properties": {
                                    "install": {"type": "string", "nullable": True},
                                    "use": {"type": "string"},
                                    "remove": {"type": "string"},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json({"type": "object", "required": ["keys"]}, "the keyring's key ids"),
                    **_error_responses(400, 403, 409, 413),
                },
            },
        },
        "/v1/events": {
            "get": {
                "operationId": "listEvents",
                "parameters": [
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["events", "next", "store"],
                            "properties": {
                                "events": {"type": "array", "items": _ref("Event")},
                                "next": {"type": "integer"},
                                "dropped": {
                                    "type": "integer",
                                    "minimum": 0,
                                    "description": "events after `after` no longer kept (events_kept)",
                                },
                                "store": {
                                    "type": "string",
                                    "description": (
                                        "the identity of the store the events are kept in; another (a new or wiped state "
                                        "directory) numbers its events from 1 again. Empty while a store from an earlier "
                                        "version, full at start, cannot keep it"
                                    ),
                                },
                            },
                        },
                        "events",
                    ),
                    **_error_responses(400),
                },
            }
        },
        "/v1/stream": {
            "get": {
                "operationId": "streamEvents",
                "summary": (
                    "the events as Server-Sent Events (id: seq, event: type, data: the event), after Last-Event-ID or `after` "
                    "(from the first when that is past the newest: another store's); `cluster` when the view changes; "
                    "`dropped` ({dropped, after, next}, no id) where events after the resume point are no longer kept"
                ),
                "x-stream": True,
                "parameters": [
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer", "minimum": 0}},
                ],
                "responses": {
                    "200": {"description": "an endless event stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                    **_error_responses(400, 429),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "the Prometheus text format, or OpenMetrics when the Accept header asks for it",
                        "content": {
                            "text/plain": {"schema": {"type": "string"}},
                            "application/openmetrics-text": {"schema": {"type": "string"}},
                        },
                    }
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["ok", "node", "driver_error", "unreadable_gpus", "missing_gpus", "stale", "store_error"],
                            "properties": {
                                "ok": {"type": "boolean"},
                                "node": {"type": "string"},
                                "driver_error": {"type": "string", "nullable": True, "description": "why the GPUs cannot be read"},
                                "unreadable_gpus": {
                                    "type": "array",
                                    "items": _ref("UnreadableGpu"),
                                    "description": "GPUs the driver lists but cannot read (the others are read and brokered)",
                                },
                                "missing_gpus": {
                                    "type": "array",
                                    "items": _ref("MissingGpu"),
                                    "description": "GPUs that leases hold and the driver no longer lists (none is offered)",
                                },
                                "stale": {"type": "boolean", "description": "a GPU's reading is older than `staleness`"},
                                "store_error": {
                                    "type": "string",
                                    "nullable": True,
                                    "description": (
                                        "why the state store's writes fail (full, a disk fault): set at the first failure, cleared once "
                                        "none has failed for 5 s"
                                    ),
                                },
                            },
                        },
                        "alive",
                    )
                },
            }
        },
    },
    # Needed only where the broker has a UI password (always beyond loopback): the node's API token, or a signed-in
    # session (with its CSRF token on changes); a caller without either gets 401 UNAUTHORIZED.
    "security": [{}, {"apiToken": []}],
    "components": {
        "securitySchemes": {"apiToken": {"type": "http", "scheme": "bearer", "description": "`gpubroker token` on the node prints it"}},
        "schemas": {
            "LeaseRequest": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "gpu_memory": _SIZE,
                    "gpus": {"type": "integer", "minimum": 0, "maximum": MAX_GPUS},
                    "exclusive": {"type": "boolean"},
                    "gpu": {
                        "oneOf": [
                            {"type": "integer", "minimum": 0, "maximum": MAX_GPUS - 1},
                            {"type": "string", "minLength": 1, "maxLength": MAX_TEXT},
                        ]
                    },
                    "cpu_cores": {"type": "integer", "minimum": 0, "maximum": MAX_CORES},
                    "memory": _SIZE,
                    "priority": {"type": "string", "enum": list(CLASSES)},
                    "preemption": {"type": "string", "enum": list(PREEMPTIONS), "nullable": True},
                    "ttl": _TTL,
                    "wait": _DURATION,
                    "deadline": {"type": "string", "format": "date-time"},
                    "holder": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT},
                            "pid": {"type": "integer", "minimum": 1, "maximum": MAX_PID},
                        },
                    },
                    "bind": {"type": "string", "enum": list(BINDS)},
                    "labels": {
                        "type": "object",
                        "maxProperties": MAX_LABELS,
                        "additionalProperties": {"type": "string", "maxLength": MAX_TEXT},
                    },
                },
            },
            "Lease": {
                "type": "object",
                "required": ["id", "state", "node", "priority", "holder"],
                "properties": {
                    "id": {"type": "string"},
                    "state": {"type": "string", "enum": ["queued", "granted", "released", "expired", "revoked"]},
                    "node": {"type": "string"},
                    "epoch": {
                        "type": "integer",
                        "nullable": True,
                        "description": "null only for another node's lease its document does not give it for",
                    },
                    "priority": {"type": "string", "enum": list(CLASSES)},
                    "preemption": {"type": "string", "enum": list(PREEMPTIONS), "nullable": True},
                    "bind": {"type": "string", "enum": list(BINDS)},
                    "holder": {"type": "object"},
                    "gpus": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["index", "uuid", "bytes", "epoch"],
                            "properties": {"epoch": {"type": "integer", "nullable": True}},  # null as the lease's may be
                        },
                    },
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "token": {"type": "string", "description": "only in the answer to the request that was granted"},
                    "exclusive": {"type": "boolean"},
                    "cpu_cores": {"type": "integer", "minimum": 0},
                    "memory": {"type": "integer", "minimum": 0, "description": "bytes of host memory"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "granted_at": {"type": "string", "format": "date-time", "nullable": True},
                    "expires_at": {"type": "string", "format": "date-time", "nullable": True},
                    "ttl": {"type": "number", "description": "seconds; a renewal without a ttl extends the lease by this from then"},
                    "process_groups": {"type": "array", "items": {"type": "integer"}, "description": "registered process groups"},
                    "ended_at": {"type": "string", "format": "date-time", "description": "once released, expired or revoked"},
                    "reason": {"type": "string", "nullable": True, "description": "why it ended; for a waiting request, why it waits"},
                    "position": {"type": "integer", "minimum": 1, "description": "a waiting request's place in its class's queue"},
                    "waiting_behind": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "the waiting requests ahead that hold a waiting request's GPUs back",
                    },
                    "queued_at": {"type": "string", "format": "date-time", "description": "when a waiting request began to wait"},
                    "request": {"type": "object", "description": "what a waiting request asks for, sizes in bytes"},
                },
            },
            "Figures": {
                "type": "object",
                "required": ["total", "observed", "external", "resident", "leased", "reserve", "schedulable"],
                "properties": {
                    name: {"type": "integer", "minimum": 0}
                    for name in ("total", "observed", "external", "resident", "leased", "reserve", "schedulable")
                },
            },
            "Node": {
                "type": "object",
                "required": ["node", "gpus", "cpu", "memory"],
                "properties": {
                    "node": {"type": "object", "required": ["id", "name", "production_eligible", "version"]},
                    "gpus": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["index", "uuid", "name", "observed_at", "figures", "processes"],
                            "properties": {
                                "index": {"type": "integer", "minimum": 0},
                                "uuid": {"type": "string"},
                                "name": {"type": "string"},
                                "observed_at": {"type": "string", "format": "date-time", "description": "when it was last read"},
                                "figures": _ref("Figures"),
                                "unattributed": {
                                    "type": "integer",
                                    "minimum": 0,
                                    "description": "bytes of `external` that no process the driver lists explains",
                                },
                                "pressure": {
                                    "type": "boolean",
                                    "description": "external usage has grown into leased or reserved memory (EXTERNAL_GPU_PRESSURE)",
                                },
                                "processes": {
                                    "type": "array",
                                    "description": "what uses it: pid, name, bytes, and the lease it counts for (null: external)",
                                    "items": {"type": "object"},
                                },
                                "leases": {
                                    "type": "array",
                                    "description": "the live leases on it: id, holder, bytes declared here and used by their processes",
                                    "items": {"type": "object"},
                                },
                                "age": {"type": "number", "minimum": 0, "description": "seconds since it was read"},
                                "stale": {
                                    "type": "boolean",
                                    "description": "its reading is older than `staleness`: no decision is made on it",
                                },
                            },
                        },
                    },
                    "driver_error": {"type": "string", "nullable": True, "description": "why no GPU can be read"},
                    "unreadable_gpus": {
                        "type": "array",
                        "description": "GPUs the driver lists but cannot read: none is offered, the leases on them stay",
                        "items": {
                            "type": "object",
                            "required": ["index", "uuid", "error", "leases"],
                            "properties": {
                                **_UNREADABLE,
                                "leases": {"type": "array", "items": {"type": "string"}, "description": "live leases held on it"},
                            },
                        },
                    },
                    "missing_gpus": {
                        "type": "array",
                        "description": (
                            "GPUs that leases hold and the driver no longer lists (a card fallen off the bus): none is offered, "
                            "the leases on them stay until released or expired, counted on no other GPU; each is shown until "
                            "it is listed again or no lease holds it"
                        ),
                        "items": {
                            "type": "object",
                            "required": ["index", "uuid", "name", "since", "leases", "bytes"],
                            "properties": {
                                **_MISSING,
                                "leases": {"type": "array", "items": {"type": "string"}, "description": "live leases held on it"},
                            },
                        },
                    },
                    "cpu": {"type": "object", "description": "cores, leased, schedulable"},
                    "memory": {"type": "object", "description": "host memory in bytes: total, leased, schedulable"},
                    "queue": {
                        "type": "object",
                        "description": "waiting requests by class",
                        "additionalProperties": {"type": "integer", "minimum": 0},
                    },
                },
            },
            "MissingGpu": {
                "type": "object",
                "required": ["index", "uuid", "name", "since", "bytes"],
                "properties": _MISSING,
            },
            "UnreadableGpu": {
                "type": "object",
                "required": ["index", "uuid", "error"],
                "properties": _UNREADABLE,
            },
            "Event": {
                "type": "object",
                "required": ["seq", "time", "type", "message", "details", "node"],
                "properties": {
                    "seq": {"type": "integer"},
                    "time": {"type": "string"},
                    "type": {
                        "type": "string",
                        "description": "what happened: lease.granted, lease.released, lease.expired, lease.work_stopped (the work an "
                        "ended lease left running was stopped; details: pgids, signal, killed, grace), gpu.pressure.started, ... "
                        "(the README's Events section lists every type, with its details)",
                    },
                    "code": {"type": "string"},
                    "message": {"type": "string"},
                    "details": {"type": "object"},
                    "node": {"type": "string"},
                    "lease": {"type": "string"},
                    "gpu": {"type": "string"},
                },
            },
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["code", "message", "details"],
                        "properties": {
                            "code": {"type": "string", "enum": [c.value for c in FailureCode]},
                            "message": {"type": "string"},
                            "details": {"type": "object"},
                        },
                    }
                },
            },
        },
    },
}

# Any operation may answer these: 401 where a UI password is set and the caller has neither a session nor the API
# token, 403 on TCP to a Host that is not this broker's (against DNS rebinding), 415 to a body in a Content-Encoding it
# does not read (not identity, gzip or deflate), 417 to an Expect header other than 100-continue.
for _item in OPENAPI["paths"].values():
    for _operation in _item.values():
        _operation["responses"] = dict(sorted({**_error_responses(401, 403, 415, 417), **_operation["responses"]}.items()))

# The query parameters each operation takes, by method and path as the document writes them: the API refuses any other
# (and any given twice), so that what is documented and what is read cannot drift apart.
QUERY_PARAMETERS: dict[tuple[str, str], tuple[str, ...]] = {
    (method.upper(), path): tuple(p["name"] for p in operation.get("parameters", []) if p["in"] == "query")
    for path, item in OPENAPI["paths"].items()
    for method, operation in item.items()
}
