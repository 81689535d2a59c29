"""Sizes, durations and times as SPEC §3.1 writes them, and how figures are printed."""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*$", re.ASCII)
# RFC 3339's date-time, nothing looser: ISO 8601's other forms are not accepted.
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:[Zz]|[+-]\d{2}:\d{2})$", re.ASCII)
# Far beyond any real card or machine; keeps arithmetic and JSON integers sane.
MAX_BYTES = 2**60
MAX_SECONDS = 10 * 365 * 86400.0


class UnitError(ValueError):
    """A size, duration or time that is not written as SPEC §3.1 allows."""


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as `8GiB`, `512MiB` or `8GB`."""
    if isinstance(value, bool):
        raise UnitError(f"size must be bytes or a string with a unit, not {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = _size_text(value)
    elif isinstance(value, float):  # TOML's and JSON's 1.5: bytes are whole, a fraction is written with its unit
        raise UnitError(
            f"size {value!r} is a number with a decimal point: give bytes as an integer, or a string with a unit (1.5GiB, 512MiB, 8GB)"
        )
    else:
        raise UnitError(f"size must be bytes or a string with a unit, not {type(value).__name__}")
    if size < 0 or size > MAX_BYTES:
        raise UnitError(f"size {value!r} is out of range (0 to 2^60 bytes)")
    return size


@functools.lru_cache(maxsize=256)  # requests repeat a few sizes ("24GiB"): each text is read once
def _size_text(text: str) -> int:
    match = _NUMBER_WITH_UNIT.match(text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise UnitError(f"size {text!r} is not bytes or a number with a unit (8GiB, 512MiB, 8GB)")
    number, unit = match.group(1), match.group(2).upper()
    if "." in number and _SIZE_UNITS[unit] == 1:  # `1.5`, most likely meant as 1.5 GiB
        raise UnitError(f"size {text!r} is a fraction of a byte: a size without a unit is bytes; write its unit (1.5GiB, 512MiB)")
    # Exact arithmetic: byte counts beyond 2^53 must not be rounded by floats.
    exact = int(number) if "." not in number else Fraction(number)
    return int(exact * _SIZE_UNITS[unit])


def parse_duration(value: object) -> float:
    """Seconds from an integer or a string such as `500ms`, `30s`, `10m` or `1h`."""
    if isinstance(value, bool):
        raise UnitError(f"duration must be seconds or a string with a unit, not {value!r}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_SECONDS:
            raise UnitError(f"duration {value!r} is out of range (0 to 10 years)")
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration_text(value)
    elif isinstance(value, float):  # TOML's and JSON's 2.5: whole seconds as a number, anything finer as a string
        # Written out in full: `{:g}` gives 1e-05 or 1.23457e+06, which no duration is written as.
        written = duration_text(value) if 0 < value <= MAX_SECONDS else ""
        example = written if 0 < len(written) <= 31 else "30s"
        raise UnitError(
            f"duration {value!r} is a number with a decimal point: give seconds as an integer, or a string with a unit ({example}, 500ms)"
        )
    else:
        raise UnitError(f"duration must be seconds or a string with a unit, not {type(value).__name__}")
    if seconds < 0 or seconds > MAX_SECONDS:
        raise UnitError(f"duration {value!r} is out of range (0 to 10 years)")
    return seconds


def duration_text(seconds: float) -> str:
    """Seconds as a duration that parse_duration reads back as the same: written out in full (`{:g}` writes 1e+06)."""
    return f"{Decimal(repr(float(seconds))):f}s"


@functools.lru_cache(maxsize=256)  # as for sizes: a few texts ("10m") come again and again
def _duration_text(text: str) -> float:
    match = _NUMBER_WITH_UNIT.match(text)
    unit = match.group(2) if match else None
    if not match or (unit and unit not in _DURATION_UNITS):
        raise UnitError(f"duration {text!r} is not seconds or a number with a unit (500ms, 30s, 10m, 1h)")
    return float(match.group(1)) * _DURATION_UNITS[unit or "s"]


def parse_time(value: object) -> float:
    """A Unix time from an RFC 3339 string (`2026-11-30T10:00:00Z`)."""
    if not isinstance(value, str) or not _RFC3339.match(value):
        raise UnitError(f"time {value!r} is not RFC 3339 with a time zone (2026-11-30T10:00:00Z)")
    text = value.upper()
    if "." in text:  # Python reads at most microseconds
        head, _, tail = text.partition(".")
        digits = re.match(r"\d*", tail, re.ASCII).group()  # type: ignore[union-attr]
        text = f"{head}.{digits[:6].ljust(6, '0')}{tail[len(digits) :]}"
    try:
        parsed = datetime.fromisoformat(text)
        timestamp = parsed.timestamp()
        rfc3339(timestamp)  # an instant beyond year 1 to 9999 in UTC cannot be written back
    except (ValueError, OverflowError):
        raise UnitError(f"time {value!r} is not a valid date and time from year 1 to 9999") from None
    return timestamp


@functools.lru_cache(maxsize=4096)  # a lease's times are written in every answer and page that shows it
def rfc3339(timestamp: float) -> str:
    """The RFC 3339 form of a Unix time, in UTC, to the millisecond."""
    moment = datetime.fromtimestamp(timestamp, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log_line(text: str) -> None:
    """One line of the broker's log (its standard error, a service's journal), printable. A log nobody reads any
    more (a closed pipe, a full disk) is not a reason for the broker to fail: the line is lost, the broker goes on."""
    with contextlib.suppress(OSError, ValueError):
        print(f"gpubroker: {printable_text(text)}", file=sys.stderr, flush=True)


def gib(size: int | None) -> str:
    """A size as GiB with one decimal, as every message prints figures."""
    if size is None:
        return "unmeasured"
    return f"{size / 2**30:.1f}"


def short_by(need: int, have: int, what: str = "left") -> str:
    """What a refusal adds to `needs {gib(need)}` when one decimal shows the need and what is left alike
    ("17.0 schedulable; needs 17.0"): by how much it falls short, so the message says why. `what` names
    the figure it falls short of ("left", "in all", "it can lease")."""
    if need <= have or gib(need) != gib(have):
        return ""
    short = need - have
    return (
        f" ({-(-short // 2**20)} MiB more than the {gib(have)} {what})"
        if short >= 2**20
        else f" ({short} byte{'s' * (short != 1)} more than the {gib(have)} {what})"
    )


# C0 and C1 control characters (DEL among them), and what reorders or hides text around it where it is shown: the
# bidirectional marks, embeddings, overrides and isolates, zero-width characters and the line and paragraph separators;
# and what shows as nothing: the combining grapheme joiner, the Hangul fillers, Khmer's inherent vowels, Mongolian's
# vowel separator and variation selectors, the interlinear annotation marks and the tag characters. (A soft hyphen is
# text, shown where a line breaks.)
CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u2069"
    "\u3164\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e007f]"
)


def printable_text(text: str, keep: str = "") -> str:
    """Text fit to store and print: a lone surrogate (a name psutil read from bytes that are not UTF-8,
    or a JSON escape) becomes its escape, since one such string would fail every write beside it, and so
    does a control character other than those in `keep`, which would act on the terminal that prints it
    (ESC clears it; CR, LF forge lines)."""
    encodable = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return CONTROL.sub(lambda m: m.group() if m.group() in keep else _escape(m.group()), encodable)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def host_part(cpu_cores: int, memory: int) -> list[str]:
    """What of the host a lease holds, as its grant is said beside its GPUs (`2 CPU cores`, `4.0 GiB memory`)."""
    said = [f"{cpu_cores} CPU core{'s' if cpu_cores != 1 else ''}"] if cpu_cores else []
    return said + ([f"{gib(memory)} GiB memory"] if memory else [])
