"""The failure codes of SPEC §3.6 and the one error tree.

    BrokerError                 code, message, details; .status is the HTTP status
    ├── InvalidRequest          INVALID_REQUEST: input that is not a valid request
    ├── NotFound                NOT_FOUND: an unknown lease or path
    ├── Forbidden               FORBIDDEN: a foreign Host, someone else's lease
    ├── Refusal                 any other code: a decision, with the figures that explain it
    └── StoreFull               the state store is full (507); nothing was changed

Every error keeps its facts in `details`; the HTTP layer turns any of them into
`{"error": {"code", "message", "details"}}` and the broker records it as an event.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class FailureCode(StrEnum):
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"
    GPU_OOM = "GPU_OOM"
    RUNTIME_CRASH = "RUNTIME_CRASH"
    TIMEOUT = "TIMEOUT"
    HEALTHCHECK_FAILED = "HEALTHCHECK_FAILED"
    INVALID_OUTPUT = "INVALID_OUTPUT"
    ARTIFACT_CORRUPT = "ARTIFACT_CORRUPT"
    CAPABILITY_UNAVAILABLE = "CAPABILITY_UNAVAILABLE"
    DRIVER_ERROR = "DRIVER_ERROR"
    SCHEDULER_STATE_STALE = "SCHEDULER_STATE_STALE"
    INSUFFICIENT_SCHEDULABLE_VRAM = "INSUFFICIENT_SCHEDULABLE_VRAM"
    EXTERNAL_GPU_PRESSURE = "EXTERNAL_GPU_PRESSURE"
    RESIDENCY_CONFLICT = "RESIDENCY_CONFLICT"
    EVICTION_NOT_ALLOWED = "EVICTION_NOT_ALLOWED"
    DEADLINE_CANNOT_BE_MET = "DEADLINE_CANNOT_BE_MET"
    LEASE_CONFLICT = "LEASE_CONFLICT"
    GPU_MEMORY_NOT_RECLAIMED = "GPU_MEMORY_NOT_RECLAIMED"
    QUEUE_FULL = "QUEUE_FULL"
    LEASE_TIMEOUT = "LEASE_TIMEOUT"
    INVALID_REQUEST = "INVALID_REQUEST"
    NOT_FOUND = "NOT_FOUND"
    FORBIDDEN = "FORBIDDEN"
    UNAUTHORIZED = "UNAUTHORIZED"
    STORE_FULL = "STORE_FULL"


_STATUS = {
    FailureCode.INVALID_REQUEST: 400,
    FailureCode.UNAUTHORIZED: 401,
    FailureCode.FORBIDDEN: 403,
    FailureCode.NOT_FOUND: 404,
    FailureCode.QUEUE_FULL: 429,
    FailureCode.MODEL_LOAD_FAILED: 502,
    FailureCode.RUNTIME_CRASH: 502,
    FailureCode.HEALTHCHECK_FAILED: 502,
    FailureCode.INVALID_OUTPUT: 502,
    FailureCode.GPU_OOM: 502,
    FailureCode.TIMEOUT: 504,
    FailureCode.DRIVER_ERROR: 503,
    FailureCode.SCHEDULER_STATE_STALE: 503,
    FailureCode.ARTIFACT_CORRUPT: 503,
    FailureCode.STORE_FULL: 507,
}


def http_status(code: FailureCode) -> int:
    """The HTTP status of a failure code, as SPEC §3.6's table gives it (409 for the decisions)."""
    return _STATUS.get(code, 409)


class BrokerError(Exception):
    """A typed failure: a code, a sentence that names the figures, and the figures."""

    def __init__(self, code: FailureCode, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details: dict[str, Any] = details or {}
        self.recorded = False  # True once the broker has kept it as an event (a decision's refusal)

    @property
    def status(self) -> int:
        return http_status(self.code)

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code.value, "message": self.message, "details": self.details}}


class InvalidRequest(BrokerError):
    def __init__(self, message: str, details: dict[str, Any] | None = None, status: int = 400) -> None:
        super().__init__(FailureCode.INVALID_REQUEST, message, details)
        self._status = status

    @property
    def status(self) -> int:
        return self._status  # 413 for an oversized body, 405 for a wrong method


class NotFound(BrokerError):
    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(FailureCode.NOT_FOUND, message, details)


class Forbidden(BrokerError):
    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(FailureCode.FORBIDDEN, message, details)


class Unauthorized(BrokerError):
    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(FailureCode.UNAUTHORIZED, message, details)


class Refusal(BrokerError):
    """A decision not to grant, with the figures behind it."""


class StoreFull(BrokerError):
    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(FailureCode.STORE_FULL, message, details)
