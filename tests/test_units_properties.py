"""Properties of the decoders of SPEC §3.1: sizes, durations and times. Anything else is a UnitError, never a crash."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gpubroker.ui.openapi import OPENAPI
from gpubroker.units import (
    CONTROL,
    MAX_BYTES,
    MAX_SECONDS,
    UnitError,
    duration_text,
    gib,
    parse_duration,
    parse_size,
    parse_time,
    printable_text,
    rfc3339,
    short_by,
)

SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_REQUEST = OPENAPI["components"]["schemas"]["LeaseRequest"]["properties"]
SIZE_PATTERN = next(form["pattern"] for form in _REQUEST["gpu_memory"]["oneOf"] if form["type"] == "string")
DURATION_PATTERN = next(form["pattern"] for form in _REQUEST["ttl"]["oneOf"] if form["type"] == "string")
EXACT = 2**53  # below this a float holds every integer, so the decoders' float arithmetic is exact

# Values that are neither an integer nor a string (bytes too, which JSON cannot carry), nested a little.
NOT_NUMBER_OR_TEXT = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)


def _decoded_or_out_of_range(parse: Any, text: str) -> float:
    """What a decoder reads from text, or 0 when its only complaint is the range."""
    try:
        value: float = parse(text)
    except UnitError as error:
        problem = str(error)
    else:
        assert value >= 0
        return value
    assert "out of range" in problem, problem
    return 0


# ----- sizes --------------------------------------------------------------------------


@given(st.sampled_from(sorted(SIZE_UNITS)), st.data())
def test_a_whole_number_of_any_size_unit_is_that_many_bytes(unit: str, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, min(MAX_BYTES, EXACT) // SIZE_UNITS[unit]))
    assert parse_size(f"{n}{unit}") == n * SIZE_UNITS[unit]
    assert parse_size(f" {n} {unit.lower()} ") == n * SIZE_UNITS[unit]  # units are case-blind; spaces are allowed


@given(st.integers(0, 2**30))
def test_n_gib_is_n_times_2_to_the_30(n: int) -> None:
    assert parse_size(f"{n}GiB") == n * 2**30


@given(st.integers(0, MAX_BYTES))
def test_an_integer_size_passes_through_as_is(n: int) -> None:
    size = parse_size(n)
    assert size == n
    assert type(size) is int


@given(st.integers(0, EXACT))
def test_a_bare_number_string_is_bytes(n: int) -> None:
    assert parse_size(str(n)) == n


@given(st.integers(0, 2**20), st.sampled_from(["KiB", "MiB", "GiB"]))
def test_a_half_unit_adds_half_the_unit(n: int, unit: str) -> None:
    assert parse_size(f"{n}.5{unit}") == n * SIZE_UNITS[unit] + SIZE_UNITS[unit] // 2


@pytest.mark.parametrize("text", ["1.5", "0.4", "1.5B", "24.0 b", "0.5"])
def test_a_fraction_of_a_byte_is_refused_saying_to_write_the_unit(text: str) -> None:
    """`--gpu-memory 1.5`, meant as 1.5 GiB, was granted as 1 byte (and `0.4B` refused as asking for nothing)."""
    with pytest.raises(UnitError) as refused:
        parse_size(text)
    assert str(refused.value) == f"size {text!r} is a fraction of a byte: a size without a unit is bytes; write its unit (1.5GiB, 512MiB)"
    assert not re.fullmatch(SIZE_PATTERN, text)  # nor does the API's document allow it


@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_BYTES + 1)))
def test_an_integer_size_below_zero_or_above_2_to_the_60_is_refused(n: int) -> None:
    with pytest.raises(UnitError):
        parse_size(n)


@given(st.integers(1, 2**40), st.sampled_from([*SIZE_UNITS, ""]))
def test_a_negative_size_string_is_refused(n: int, unit: str) -> None:
    with pytest.raises(UnitError):
        parse_size(f"-{n}{unit}")


@given(NOT_NUMBER_OR_TEXT)
def test_a_size_that_is_not_an_integer_or_a_string_is_refused(value: Any) -> None:
    with pytest.raises(UnitError):
        parse_size(value)


@pytest.mark.parametrize(
    "text",
    ["", " ", "GiB", "8 GiB B", "8GiBs", "8Gi", "8PiB", "8iB", "1e3", "0x10", "1_000", "8.GiB", ".5GiB", "8,5GiB", "+8GiB", "NaN", "inf"],
)
def test_a_size_not_written_as_spec_3_1_allows_is_refused(text: str) -> None:
    with pytest.raises(UnitError):
        parse_size(text)


@given(st.text(max_size=30))
@example("9" * 40 + "TiB")
@example(" 0.0 b ")
def test_any_text_is_a_size_in_range_or_a_unit_error(text: str) -> None:
    try:
        size = parse_size(text)
    except UnitError:
        return
    assert type(size) is int
    assert 0 <= size <= MAX_BYTES


@given(st.from_regex(SIZE_PATTERN, fullmatch=True).filter(lambda text: len(text) < 200))
def test_every_size_string_the_openapi_document_allows_is_decoded(text: str) -> None:
    # The document is the truth the API is fuzzed from: what it allows, the decoder reads (or finds out of range).
    assert _decoded_or_out_of_range(parse_size, text) <= MAX_BYTES


# ----- durations ----------------------------------------------------------------------


@given(st.sampled_from(sorted(DURATION_UNITS)), st.data())
def test_a_whole_number_of_any_duration_unit_is_that_many_seconds(unit: str, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, int(MAX_SECONDS / DURATION_UNITS[unit])))
    assert math.isclose(parse_duration(f"{n}{unit}"), n * DURATION_UNITS[unit], rel_tol=1e-12)
    assert math.isclose(parse_duration(f" {n} {unit} "), n * DURATION_UNITS[unit], rel_tol=1e-12)


@given(st.integers(0, int(MAX_SECONDS)))
def test_an_integer_duration_is_seconds(n: int) -> None:
    seconds = parse_duration(n)
    assert seconds == n
    assert type(seconds) is float
    assert parse_duration(str(n)) == n  # a bare number string is seconds too


@given(st.integers(0, 10**6), st.integers(0, 999))
def test_a_fractional_duration_keeps_its_fraction(n: int, millis: int) -> None:
    assert math.isclose(parse_duration(f"{n}.{millis:03d}s"), n + millis / 1000, rel_tol=1e-12, abs_tol=1e-9)


@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=int(MAX_SECONDS) + 1, max_value=10**300)))
def test_an_integer_duration_below_zero_or_beyond_ten_years_is_refused(n: int) -> None:
    with pytest.raises(UnitError):
        parse_duration(n)


@given(st.integers(1, 10**9), st.sampled_from([*DURATION_UNITS, ""]))
def test_a_negative_duration_string_is_refused(n: int, unit: str) -> None:
    with pytest.raises(UnitError):
        parse_duration(f"-{n}{unit}")


@given(NOT_NUMBER_OR_TEXT)
def test_a_duration_that_is_not_an_integer_or_a_string_is_refused(value: Any) -> None:
    with pytest.raises(UnitError):
        parse_duration(value)


@pytest.mark.parametrize("text", ["", "s", "10 M", "10H", "1d", "1us", "1 min", "1h30m", "1e3s", "PT1H", "-0s0", "inf", "NaN"])
def test_a_duration_not_written_as_spec_3_1_allows_is_refused(text: str) -> None:
    with pytest.raises(UnitError):
        parse_duration(text)


@given(st.text(max_size=30))
@example("9" * 400)
@example("9" * 400 + "ms")
def test_any_text_is_a_duration_in_range_or_a_unit_error(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except UnitError:
        return
    assert type(seconds) is float
    assert 0 <= seconds <= MAX_SECONDS


@given(st.from_regex(DURATION_PATTERN, fullmatch=True).filter(lambda text: len(text) < 200))
def test_every_duration_string_the_openapi_document_allows_is_decoded(text: str) -> None:
    assert _decoded_or_out_of_range(parse_duration, text) <= MAX_SECONDS


# ----- times --------------------------------------------------------------------------

OFFSETS = st.integers(-(14 * 60 - 1), 14 * 60 - 1).map(lambda minutes: timezone(timedelta(minutes=minutes)))
MOMENTS = st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=OFFSETS)


def _rfc3339(moment: datetime, zulu: bool) -> str:
    """RFC 3339 as a client writes it: seconds always, a fraction sometimes, Z or ±HH:MM."""
    text = moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")
    if zulu and moment.utcoffset() == timedelta(0):
        text = text.replace("+00:00", "Z")
    return text


@given(MOMENTS, st.booleans())
def test_an_rfc_3339_time_is_its_unix_time(moment: datetime, zulu: bool) -> None:
    assert parse_time(_rfc3339(moment, zulu)) == moment.timestamp()


@given(st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9998, 12, 31)))
def test_a_time_printed_by_rfc3339_reads_back_to_the_millisecond(moment: datetime) -> None:
    stamp = moment.replace(tzinfo=UTC).timestamp()
    printed = rfc3339(stamp)
    assert printed.endswith("Z")
    assert "T" in printed
    assert abs(parse_time(printed) - stamp) < 0.0011


@given(st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31)))
def test_a_time_without_a_zone_is_refused(moment: datetime) -> None:
    with pytest.raises(UnitError, match="time zone"):
        parse_time(moment.isoformat())


@given(st.one_of(NOT_NUMBER_OR_TEXT, st.integers()))
def test_a_time_that_is_not_a_string_is_refused(value: Any) -> None:
    with pytest.raises(UnitError):
        parse_time(value)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "T",
        "2026-11-30",
        "10:00:00Z",
        "2026-13-01T00:00:00Z",
        "2026-11-31T00:00:00Z",
        "2026-11-30T24:00:00Z",
        "yesterdayT",
        "2026-11-30T10:00:00+25:00",
    ],
)
def test_a_time_not_written_as_rfc_3339_is_refused(text: str) -> None:
    with pytest.raises(UnitError):
        parse_time(text)


@given(st.text(max_size=40))
@example("2026-11-30T10:00:00Z\x00")
@example("0001-01-01T00:00:00+01:00")
def test_any_text_is_a_time_or_a_unit_error(text: str) -> None:
    try:
        moment = parse_time(text)
    except UnitError:
        return
    assert isinstance(moment, float)
    assert math.isfinite(moment)


@given(st.from_regex(r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?([Zz]|[+-][0-9]{2}:[0-9]{2})\Z"))
def test_text_shaped_like_rfc_3339_is_a_time_or_a_unit_error(text: str) -> None:
    try:
        moment = parse_time(text)
    except UnitError:
        return
    assert math.isfinite(moment)


# ----- bugs found here: each fails today ------------------------------------------------


@pytest.mark.parametrize("value", [10**309, -(10**400)])
def test_a_huge_integer_duration_is_a_unit_error(value: int) -> None:
    with pytest.raises(UnitError):
        parse_duration(value)


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "GiB", "1" * 309 + "0.5KB"])
def test_a_size_with_hundreds_of_digits_is_a_unit_error(text: str) -> None:
    with pytest.raises(UnitError):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "size"), [("9007199254740993", 2**53 + 1), ("1152921504606846975B", 2**60 - 1), ("1152921504606845KB", 1152921504606845000)]
)
def test_a_byte_count_above_2_to_the_53_is_exact(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("parse", "text"), [(parse_size, "٣GiB"), (parse_size, "３GiB"), (parse_duration, "٣s"), (parse_duration, "１０m")]
)
def test_a_number_in_non_ascii_digits_is_refused(parse: Any, text: str) -> None:
    with pytest.raises(UnitError):
        parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "20261130T100000Z",  # basic format
        "2026-W48-1T10:00:00Z",  # week date
        "2026-11-30T10Z",  # hour only
        "2026-11-30T10:00Z",  # no seconds
        "2026-11-30T10:00:00,5Z",  # comma fraction
        "2026-11-30T10:00:00+0100",  # offset without colon
        "2026-11-30T10:00:00+01:00:30",  # offset with seconds
        "2026-11-30T10:00:00 Z",  # space before the zone
    ],
)
def test_a_time_in_iso_8601_but_not_rfc_3339_is_refused(text: str) -> None:
    with pytest.raises(UnitError):
        parse_time(text)


@pytest.mark.parametrize("text", ["0001-01-01T00:00:00+00:01", "9999-12-31T23:59:59-00:01"])
def test_every_time_parse_time_accepts_can_be_printed_back(text: str) -> None:
    try:
        moment = parse_time(text)
    except UnitError:
        return
    assert rfc3339(moment)


@given(st.text(st.characters(), max_size=40))
def test_printable_text_holds_no_control_character_and_always_encodes(text: str) -> None:
    """What a process calls itself, or a refused caller sent, is stored and printed: never a raw ESC, CR or LF."""
    shown = printable_text(text)
    assert not CONTROL.search(shown)
    shown.encode("utf-8")  # no lone surrogate left
    if not CONTROL.search(text) and not any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert shown == text  # printable text is left as it is


def test_printable_text_writes_control_characters_as_their_escapes() -> None:
    assert printable_text("evil\x1b[2J\nforged\r\x85") == "evil\\x1b[2J\\x0aforged\\x0d\\x85"
    # What reorders or hides the text shown beside it (a name's right-to-left override turned "15.0" into "0.51").
    assert printable_text("job\u202e 15.0\u2028\u200b\u2066") == "job\\u202e 15.0\\u2028\\u200b\\u2066"
    # What shows as nothing, so that two names that read alike are not alike.
    assert printable_text("a\u3164\u115f\U000e0001\u180eb") == "a\\u3164\\u115f\\U000e0001\\u180eb"
    assert printable_text("naïve café 中文 \u00ad") == "naïve café 中文 \u00ad"  # letters and a soft hyphen stay


@given(st.integers(0, 2**50), st.integers(0, 2**50))
@example(17 * 2**30 + 20 * 2**20, 17 * 2**30 + 10 * 2**20)
@example(2**30 + 5, 2**30)
def test_a_refusal_says_by_how_much_a_need_falls_short_exactly_when_the_figures_read_alike(need: int, have: int) -> None:
    said = short_by(need, have)
    assert bool(said) == (need > have and gib(need) == gib(have))
    if said:
        amount = int(said.split()[0].lstrip("("))
        unit = 2**20 if " MiB " in said else 1
        assert amount * unit >= need - have > (amount - 1) * unit


@given(st.floats(1, MAX_SECONDS))  # a TTL: at least a second
@example(1e6)  # `{:g}` wrote it 1e+06s, which a renewal was refused for: a lease's own TTL was not given back after `fg`
def test_a_duration_written_by_duration_text_is_read_back_as_the_same_seconds(seconds: float) -> None:
    assert parse_duration(duration_text(seconds)) == seconds
