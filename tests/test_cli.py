"""How work whose lease ended is stopped, by `gpubroker lease` and by the broker, and the CLI's patience with a restarting broker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp import web
from conftest import free_port, wait_for
from fakes import FakeClock, FakeGpuProbe

from gpubroker import cli
from gpubroker import client as client_module
from gpubroker.broker import holders
from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.client import Client, ClientError, Endpoint
from gpubroker.config import Config
from gpubroker.ui.api import make_app


@pytest.fixture
def group() -> Any:
    """A process group whose members ignore SIGTERM, as work that will not stop when asked."""
    proc = subprocess.Popen(["sh", "-c", 'trap "" TERM; sleep 60 & wait; wait'], process_group=0)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_work_whose_lease_ended_gets_sigterm_then_sigkill_after_the_grace(group: subprocess.Popen[bytes], monkeypatch: Any) -> None:
    monkeypatch.setattr(cli, "STOP_GRACE", 0.3)
    wait_for(lambda: psutil.Process(group.pid).children(), timeout=5.0)  # the trap is set: its sleep has started
    started = time.monotonic()
    cli._stop_group(group.pid, threading.Event())
    assert group.wait(5) == -signal.SIGKILL  # SIGTERM was ignored, so SIGKILL came
    assert time.monotonic() - started >= 0.3


def test_stopped_work_whose_lease_ended_is_continued_so_sigterm_ends_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(cli, "STOP_GRACE", 30.0)
    proc = subprocess.Popen(["sleep", "60"], process_group=0)
    try:
        proc.send_signal(signal.SIGSTOP)  # Ctrl-Z
        wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] == "T", timeout=5.0)
        done = threading.Event()
        stopper = threading.Thread(target=cli._stop_group, args=(proc.pid, done))
        stopper.start()
        assert proc.wait(5) == -signal.SIGTERM  # not SIGKILL STOP_GRACE later
        done.set()  # as `gpubroker lease` does once CMD has ended
        stopper.join(5)
        assert not stopper.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_call_is_tried_again_while_no_broker_answers_and_only_then() -> None:
    answers: list[Any] = [ClientError(0, "UNREACHABLE", "restarting"), ClientError(0, "UNREACHABLE", "restarting"), {"lease": {}}]

    def call() -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert cli._when_reachable(call) == {"lease": {}}
    with pytest.raises(ClientError, match="NOT_FOUND"):
        cli._when_reachable(lambda: (_ for _ in ()).throw(ClientError(404, "NOT_FOUND", "no lease")))
    started = time.monotonic()
    with pytest.raises(ClientError, match="UNREACHABLE"):
        cli._when_reachable(lambda: (_ for _ in ()).throw(ClientError(0, "UNREACHABLE", "down")), patience=0.3)
    assert time.monotonic() - started >= 0.3


async def test_the_broker_continues_a_stopped_group_it_stops_so_sigterm_ends_it_without_waiting_for_sigkill() -> None:
    proc = subprocess.Popen(["sleep", "60"], process_group=0)
    try:
        proc.send_signal(signal.SIGSTOP)  # Ctrl-Z, and then the lease ended
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, timeout=5.0)
        stopping = asyncio.create_task(holders.stop_groups([proc.pid], [os.getuid()], [], grace=30.0))
        assert await asyncio.to_thread(proc.wait, 5) == -signal.SIGTERM  # reaped here: the broker's holders are not its children
        await asyncio.wait_for(stopping, 5)  # and the group is seen gone long before the grace
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_status_shows_the_room_of_the_nodes_up_only_and_names_the_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = {"index": 0, "figures": {"schedulable": 18 * 2**30, "total": 24 * 2**30}}
    cluster = {
        "coordinator": {"id": "n-b", "epoch": 2},
        "nodes": [
            {"id": "n-a", "name": "tower", "self": True, "state": "alive"},
            {"id": "n-b", "name": "nuc", "state": "alive", "age": 0.4, "document": {"gpus": [gpu]}},
            {"id": "n-c", "name": "old", "state": "dead", "age": 95.0, "document": {"gpus": [gpu]}},
            {"id": "n-d", "name": "new", "state": "alive", "age": None},
            {"id": "n-e", "name": "hung", "state": "alive", "age": 0.2, "document": {"gpus": [{**gpu, "stale": True}]}},
        ],
    }
    cli._print_cluster(cluster)
    assert capsys.readouterr().out.splitlines() == [
        "cluster: 5 nodes (4 up), coordinator nuc",
        "  nuc (coordinator): alive, seen 0.4s ago; GPU 0 18.0/24.0 GiB schedulable",
        "  old: dead, seen 95.0s ago",  # its last figures are no room now
        "  new: alive, no document yet",  # not "no GPUs": nothing is known of them yet
        "  hung: alive, seen 0.2s ago; GPU 0 18.0/24.0 GiB schedulable STALE (no decision is made on it)",  # a hung driver's
    ]


def test_status_shows_a_peers_leased_gpu_its_driver_no_longer_lists_from_its_document(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = {"index": 0, "figures": {"schedulable": 18 * 2**30, "total": 24 * 2**30}}
    gone = {"index": 1, "uuid": "GPU-1", "name": "RTX 4090", "since": "2026-11-30T10:00:00.000Z", "leases": ["l-1"], "bytes": 4 * 2**30}
    cluster = {
        "coordinator": None,
        "nodes": [
            {"id": "n-a", "name": "tower", "self": True, "state": "alive"},
            {"id": "n-b", "name": "nuc", "state": "alive", "age": 0.4, "document": {"gpus": [gpu], "missing_gpus": [gone, "x"]}},
            {"id": "n-c", "name": "old", "state": "alive", "age": 0.4, "document": {"gpus": [gpu]}},  # an older broker's
        ],
    }
    cli._print_cluster(cluster)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  nuc: alive, seen 0.4s ago; GPU 0 18.0/24.0 GiB schedulable, GPU 1 (GPU-1) MISSING since 2026-11-30T10:00:00.000Z: "
        "leases l-1 hold 4.0 GiB on it",
        "  old: alive, seen 0.4s ago; GPU 0 18.0/24.0 GiB schedulable",
    ]


def test_status_tells_apart_nodes_that_share_a_name_by_their_ids(capsys: pytest.CaptureFixture[str]) -> None:
    """A machine killed and joined again with a fresh --state is a new node of the same name beside its dead self."""
    gpu = {"index": 0, "figures": {"schedulable": 18 * 2**30, "total": 24 * 2**30}}
    cluster = {
        "coordinator": {"id": "n-c", "epoch": 1},
        "nodes": [
            {"id": "n-a", "name": "tower", "self": True, "state": "alive"},
            {"id": "n-b", "name": "nuc", "state": "dead", "age": 60.0, "document": {"gpus": [gpu]}},
            {"id": "n-c", "name": "nuc", "state": "alive", "age": 0.4, "document": {"gpus": [gpu]}},
        ],
    }
    cli._print_cluster(cluster)
    assert capsys.readouterr().out.splitlines() == [
        "cluster: 3 nodes (2 up), coordinator nuc (n-c)",
        "  nuc (n-b): dead, seen 60.0s ago",
        "  nuc (n-c) (coordinator): alive, seen 0.4s ago; GPU 0 18.0/24.0 GiB schedulable",
    ]


def test_nodes_list_shows_the_name_a_member_goes_by_and_the_one_it_was_admitted_with(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broker:
        def __init__(self, timeout: float | None = None) -> None: ...

        def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            assert (method, path) == ("GET", "/v1/cluster/nodes")
            members = [
                {"id": "n-a", "name": "tower", "admitted_as": "tower", "admitted_by": "n-a", "state": "self"},
                {"id": "n-b", "name": "nuc2", "admitted_as": "nuc", "admitted_by": "n-a", "state": "alive"},  # up --name nuc2
            ]
            return {"members": members, "pending": [], "removed": []}

    monkeypatch.setattr(cli, "Client", Broker)
    assert cli.main(["nodes", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "n-a  tower                self     admitted by n-a",
        "n-b  nuc2                 alive    admitted by n-a as nuc",
    ]


def test_status_of_a_node_removed_from_its_cluster_says_so_and_how_to_join_again(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = {
        "coordinator": None,
        "removed": "2026-11-30T10:40:00.000Z",
        "nodes": [{"id": "n-a", "name": "tower", "self": True, "state": "removed"}],
    }
    cli._print_cluster(cluster)
    assert capsys.readouterr().out == (
        "this node was removed from its cluster at 2026-11-30T10:40:00.000Z: it gossips with no member any more; "
        "to join again it needs a new identity (a fresh --state, then `gpubroker up --join TOKEN`)\n"
    )


def test_leases_shows_long_holder_names_and_many_gpus_whole_with_every_column_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    def lease(lease_id: str, holder: str, gpus: int) -> dict[str, Any]:
        return {
            "id": lease_id,
            "state": "granted",
            "priority": "interactive",
            "holder": {"name": holder},
            "gpus": [{"index": index, "bytes": 10 * 2**30} for index in range(gpus)],
            "expires_at": "2026-11-30T10:05:00.000Z",
        }

    cli._print_leases([lease("l-1", "train-llama-70b-lora-run-7", 8), lease("l-2", "train-llama-70b-lora-run-8", 1)])
    lines = capsys.readouterr().out.splitlines()
    assert "train-llama-70b-lora-run-7" in lines[1]  # not cut to 20 characters, where both read alike
    assert "0:10.0,1:10.0,2:10.0,3:10.0,4:10.0,5:10.0,6:10.0,7:10.0" in lines[1]
    assert {line.index("2026-11-30T10:05:00.000Z") for line in lines[1:]} == {lines[0].index("EXPIRES / REASON")}


def test_leases_shows_what_a_waiting_request_asks_of_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    def waiting(**request: Any) -> dict[str, Any]:
        asked = {"gpu_memory": 0, "gpus": 0, "exclusive": False, "gpu": None, "cpu_cores": 0, "memory": 0, **request}
        return {"id": "l-w", "state": "queued", "priority": "background", "holder": {"name": "w"}, "position": 1,
                "reason": "...", "request": asked}  # fmt: skip

    for request, shown in (
        ({"gpus": 2, "gpu_memory": 18 * 2**30}, "2x18.0"),  # not "-", which reads as a request for no GPU
        ({"gpus": 1, "gpu_memory": 2**30, "gpu": 1}, "1:1.0"),
        ({"gpus": 1, "exclusive": True}, "1xwhole"),
        ({"cpu_cores": 1}, "-"),
    ):
        cli._print_leases([waiting(**request)])
        assert capsys.readouterr().out.splitlines()[1].split()[4] == shown


def test_leases_names_the_requests_a_waiting_one_waits_behind(capsys: pytest.CaptureFixture[str]) -> None:
    """A request held back by others ahead of it says which, as the API's `waiting_behind` does."""
    asked = {"gpu_memory": 2**30, "gpus": 1, "exclusive": False, "gpu": None, "cpu_cores": 0, "memory": 0}
    for behind, said in (
        ([], "position 1: GPU 0 ..."),
        (["l-a"], "position 2, behind l-a: GPU 0 ..."),
        (["l-a", "l-b", "l-c", "l-d", "l-e"], "position 6, behind l-a, l-b, l-c and 2 more: GPU 0 ..."),
    ):
        waiting = {"id": "l-w", "state": "queued", "priority": "background", "holder": {"name": "w"}, "position": len(behind) + 1,
                   "waiting_behind": behind, "reason": "GPU 0 ...", "request": asked}  # fmt: skip
        cli._print_leases([waiting])
        assert capsys.readouterr().out.splitlines()[1].endswith(f"  {said}")


def test_every_subcommands_help_says_what_it_does_and_what_each_of_its_arguments_is() -> None:
    top = cli.parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert sub.description, f"gpubroker {name} --help says nothing of what it does"
        for action in sub._actions:
            assert action.help, f"gpubroker {name} --help: {action.option_strings or action.dest} has no help"
    lease = commands.choices["lease"].format_help()
    assert "75" in lease  # the exit code of a refusal, as the README gives it
    assert "CUDA_VISIBLE_DEVICES" in lease


def test_gpubroker_without_a_command_or_with_a_mistyped_one_names_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in (([], "the following arguments are required: COMMAND"), (["leas"], "invalid choice: 'leas'")):
        with pytest.raises(SystemExit) as usage:
            cli.main(argv)
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert said in err
        assert "command_name" not in err  # a name inside the code, which tells a user nothing
        assert "usage: gpubroker [-h] [--version] COMMAND ..." in err


def test_lease_with_nothing_after_its_double_dash_asks_for_cmd_and_takes_no_lease(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpubroker lease --gpu-memory 8GiB -- $CMD` with CMD empty took a lease bound to nothing, printed it and
    exited 0: the script went on as if its work had run, and the memory stayed held for the lease's TTL."""

    class Broker:
        def __init__(self, timeout: float | None = None) -> None:
            raise AssertionError("no broker is to be asked")

    monkeypatch.setattr(cli, "Client", Broker)
    assert cli.main(["lease", "--cpu-cores", "1", "--"]) == 2
    assert capsys.readouterr().err == "gpubroker lease: error: -- is to be followed by CMD [ARGS]\n"


@pytest.mark.parametrize("released", [True, False], ids=["released", "release-unanswered"])
def test_a_printed_lease_that_cannot_be_written_is_released_and_said_once(
    released: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the built binary's standard output does, /dev/full keeps what it could not write and fails each flush again:
    the failure is said once, by `lease`, not a second time by the flush at the end. A release the broker did not answer
    was said to be done all the same, and the lease held its GPUs, unknown, until its TTL ran out."""
    calls: list[tuple[str, str]] = []

    class Broker:
        def __init__(self, timeout: float | None = None) -> None: ...

        def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            calls.append((method, path))
            if method == "DELETE" and not released:
                raise ClientError(0, "TIMEOUT", "the broker did not answer DELETE /v1/leases/l-1 within 10s")
            lease = {"id": "l-1", "gpus": [], "epoch": 1, "ttl": 300.0, "expires_at": "T", "token": "t", "env": {"GPUBROKER_LEASE": "l-1"}}
            return {"lease": lease}

    monkeypatch.setattr(cli, "Client", Broker)
    full = open("/dev/full", "w", buffering=1 << 16)  # closed below, once main has run
    monkeypatch.setattr(sys, "stdout", full)
    try:
        assert cli.main(["lease", "--cpu-cores", "1"]) == 1
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            full.close()
    assert calls == [("POST", "/v1/leases"), ("DELETE", "/v1/leases/l-1")]
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "gpubroker: lease l-1 is released again: it could not be written out (No space left on device)"
        if released
        else "gpubroker: lease l-1 could not be written out (No space left on device), nor released again (TIMEOUT: the broker "
        "did not answer DELETE /v1/leases/l-1 within 10s): it holds what it was granted until it expires at T, unless "
        "`gpubroker release l-1` ends it first"
    ]


@pytest.mark.parametrize("path", ["", None], ids=["path-empty", "path-unset"])
def test_a_cmd_the_shell_would_find_is_not_refused_before_the_lease_is_asked_for(
    path: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With PATH empty /bin/sh runs CMD from the current directory, and with PATH unset from a default path of its own
    (dash's holds /usr/sbin and /usr/local/bin): such a CMD was refused as not found, and its work never ran."""
    work = tmp_path / "train"
    work.write_text("#!/bin/sh\nexit 0\n")
    work.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    if path is None:
        monkeypatch.delenv("PATH", raising=False)
    else:
        monkeypatch.setenv("PATH", path)
    asked: list[str] = []

    class Broker:
        def __init__(self, timeout: float | None = None) -> None:
            asked.append("lease")
            raise ClientError(0, "UNREACHABLE", "no broker in this test")

    monkeypatch.setattr(cli, "Client", Broker)
    assert cli.main(["lease", "--cpu-cores", "1", "--", "train"]) == 1
    assert asked == ["lease"]  # CMD was left for the shell to find: the lease was asked for


def test_a_release_with_its_standard_output_closed_is_done_and_exits_0_where_a_listing_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpubroker release ID >&-` released the lease, then exited 1 saying its output could not be written: a script
    took the release for failed, and asking again was refused, the lease being released already."""
    calls: list[tuple[str, str]] = []

    class Broker:
        def __init__(self, timeout: float | None = None) -> None: ...

        def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            calls.append((method, path))
            return {"lease": {"id": "l-1", "state": "released", "reason": "released by uid 0"}, "leases": [], "waiting": []}

    monkeypatch.setattr(cli, "Client", Broker)
    monkeypatch.setattr(sys, "stdout", None)  # as Python starts with its standard output closed
    assert cli.main(["release", "l-1"]) == 0
    assert calls == [("DELETE", "/v1/leases/l-1")]
    assert capsys.readouterr().err == ""
    assert cli.main(["leases", "--json"]) == 1  # a listing's output is its point
    assert capsys.readouterr().err == "gpubroker: the output could not be written: standard output is closed\n"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["lease", "--help"]], ids=["version", "help", "lease-help"])
def test_help_and_version_that_cannot_be_written_fail_as_a_listing_does(argv: list[str]) -> None:
    """argparse drops a failed write: `gpubroker --version >&-` wrote its version to standard error and exited 0, and
    with a full disk or its reader gone it exited 0 having written nothing. Now a reader gone ends it quietly with 141,
    and a closed output or a full disk is said in one line, with 1, as for `gpubroker status`."""
    run = [sys.executable, "-m", "gpubroker", *argv]
    piped = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert piped.stdout is not None
    piped.stdout.close()  # the reader gone before a word is written
    _, stderr = piped.communicate(timeout=30)
    assert (piped.returncode, stderr) == (141, b"")
    closed = subprocess.run(run, stderr=subprocess.PIPE, text=True, timeout=30, preexec_fn=lambda: os.close(1))
    assert (closed.returncode, closed.stderr) == (1, "gpubroker: the output could not be written: standard output is closed\n")
    with open("/dev/full", "w") as full:
        done = subprocess.run(run, stdout=full, stderr=subprocess.PIPE, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (1, "gpubroker: the output could not be written: No space left on device\n")


@pytest.mark.parametrize(("argv", "code"), [(["leases", "--json"], 1), (["lease", "--"], 2)])
def test_what_is_said_with_standard_error_closed_is_lost_not_written_into_the_output(tmp_path: Path, argv: list[str], code: int) -> None:
    """`gpubroker leases --json 2>&- | jq` got `gpubroker: UNREACHABLE: ...` in its JSON: Python's print() writes to
    standard output when standard error is closed. `gpubroker lease --` (CMD empty) wrote its usage error there too."""
    env = {**os.environ, "GPUBROKER_URL": f"unix:{tmp_path / 'no-broker.sock'}"}
    done = subprocess.run(
        [sys.executable, "-m", "gpubroker", *argv],
        env=env,
        stdout=subprocess.PIPE,
        timeout=30,
        preexec_fn=lambda: os.close(2),
    )
    assert (done.returncode, done.stdout) == (code, b"")


def test_the_api_token_is_never_sent_over_plain_http_beyond_this_machine() -> None:
    remote = Client(Endpoint("http://10.233.0.2:9740"))
    remote.token = "SECRET-API-TOKEN"
    with pytest.raises(ClientError, match="not sent over plain http to 10.233.0.2") as refused:
        remote.call("GET", "/v1/node")  # refused before any connection is made
    assert "GPUBROKER_URL=https://10.233.0.2:9740" in refused.value.message
    local = Client(Endpoint("http://127.0.0.1:1"))
    local.token = "SECRET-API-TOKEN"
    with pytest.raises(ClientError, match="UNREACHABLE"):  # on this machine it may go: it is tried
        local.call("GET", "/v1/node", timeout=2)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:notaport", "http://127.0.0.1:99999", "http://[::1", "http://", "https://:9740", "unix:", "http://127.0.0.1:9740/v1"],
)
def test_a_gpubroker_url_that_is_no_address_is_named_and_nothing_is_asked(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUBROKER_URL", url)
    assert cli.main(["lease", "--cpu-cores", "1", "--", "true"]) == 1
    said = capsys.readouterr().err
    assert said == f"gpubroker: INVALID_REQUEST: GPUBROKER_URL={url!r} is not unix:PATH, http://HOST:PORT or https://HOST:PORT\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--", "true"], "give --gpu-memory, --exclusive, --cpu-cores or --memory; no lease was asked for"),
        (
            ["--gpu", "1", "--", "true"],
            "give --gpu-memory, --exclusive, --cpu-cores or --memory (--gpu and --gpus say which GPUs and how many, for "
            "--gpu-memory or --exclusive); no lease was asked for",
        ),
        (["--cpu-cores", "1", "--label", "=v"], "--label '=v' is not K=V"),
        (["--cpu-cores", "1", "--label", "a=b", "--label", "a=c"], "--label a is given twice (a=b, a=c); give each key once"),
    ],
)
def test_a_lease_asked_for_in_flags_that_ask_for_nothing_or_repeat_a_label_is_refused_in_flags(
    argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpubroker lease -- true` was told to give `gpu_memory, exclusive, cpu_cores or memory`, the API's fields, and
    `--gpu 1` alone that it pins one GPU "but 0 are asked for"; a label given twice kept the last without a word."""
    monkeypatch.setenv("GPUBROKER_URL", "http://127.0.0.1:1")  # nothing may be asked: nothing answers there
    try:
        code = cli.main(["lease", *argv])
    except SystemExit as stopped:
        code = stopped.code
    assert capsys.readouterr().err == f"gpubroker: {said}\n"
    assert code == 2  # a usage error, as argparse's own: a bad label exited 1, as a failure of the broker's would


def test_release_of_an_empty_id_asks_for_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpubroker release "$ID"` with ID unset was answered `NOT_FOUND: no such path: /v1/leases/`."""
    monkeypatch.setenv("GPUBROKER_URL", "http://127.0.0.1:1")  # nothing may be asked: nothing answers there
    assert cli.main(["release", ""]) == 2
    assert capsys.readouterr().err == "gpubroker: give the id of a lease or waiting request (`gpubroker leases` lists them)\n"


def test_https_to_a_broker_that_answers_plain_http_says_to_use_http() -> None:
    """It read `no broker answers at https://…; start one with gpubroker up`, with one answering there."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer_plainly() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        threading.Thread(target=answer_plainly, daemon=True).start()
        with pytest.raises(ClientError) as refused:
            Client(Endpoint(f"https://127.0.0.1:{port}")).call("GET", "/v1/node", timeout=5)
    assert refused.value.code == "UNREACHABLE"
    assert refused.value.message == (
        f"the broker at https://127.0.0.1:{port} answers plain http, not https (a broker serves https only on a LAN address): "
        f"give GPUBROKER_URL=http://127.0.0.1:{port}"
    )


@pytest.mark.parametrize("url", ["http://alice:s3cr/et@127.0.0.1:9740", "https://alice:s3cr/et@[::1]:9740/"])
def test_a_gpubroker_url_whose_password_holds_a_slash_is_refused_without_saying_it(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A / in the password ends the address before its @: the URL was refused as no address, and printed whole."""
    monkeypatch.setenv("GPUBROKER_URL", url)
    assert cli.main(["status"]) == 1
    said = capsys.readouterr().err
    assert "s3cr" not in said
    assert said.startswith("gpubroker: INVALID_REQUEST: GPUBROKER_URL names a user (USER@HOST)"), said


def test_a_broker_that_goes_away_with_a_request_is_not_said_to_be_missing(tmp_path: Path) -> None:
    """It was there and took the request: what it was asked may have been done (a grant on disk), so the user is told
    to look before asking again, not to start a broker."""
    path = tmp_path / "api.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def take_and_vanish() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.close()

    taker = threading.Thread(target=take_and_vanish)
    taker.start()
    try:
        with pytest.raises(ClientError) as gone:
            Client(Endpoint(f"unix:{path}")).call("POST", "/v1/leases", {"gpu_memory": "1GiB"})
    finally:
        taker.join(5)
        server.close()
    assert "went away while it handled POST /v1/leases" in gone.value.message
    assert "look (`gpubroker leases`, `gpubroker events`) before asking again" in gone.value.message
    assert "start one" not in gone.value.message


@pytest.mark.parametrize("named", [True, False], ids=["in-GPUBROKER_URL", "found"])
def test_a_user_kept_from_the_brokers_socket_is_told_so_not_to_start_a_broker(tmp_path: Path, named: bool) -> None:
    """A broker whose socket is in a directory closed to other users: they were told that no broker answers there
    and to start one with `gpubroker up`, while one does, and starting another would not let them in. Found where
    clients look (the default socket), with nothing answering on TCP either, it is named as the likely broker."""
    closed = tmp_path / "run" / "gpubroker"
    closed.mkdir(parents=True)
    path = closed / "api.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    closed.chmod(0)  # closed to everyone but root, who may pass any directory: root asks as nobody below
    asker = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else os.getuid()
    reads, writes = os.pipe()
    child = os.fork()
    if child == 0:  # the child asks and says through the pipe what it was told
        said = "connected"
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(pwd.getpwuid(asker).pw_gid)
                os.setuid(asker)
            os.environ.pop("GPUBROKER_URL", None)
            os.environ["XDG_RUNTIME_DIR"] = str(tmp_path / "run")  # its default socket is the closed one
            # Where a client looks after its own socket, made places where nothing answers, whatever runs on this machine.
            client_module.SYSTEM_SOCKET = tmp_path / "no-system.sock"
            client_module.DEFAULT_URL = f"http://127.0.0.1:{free_port()}"
            Client(Endpoint(f"unix:{path}") if named else None, timeout=5).call("GET", "/healthz")
        except ClientError as error:
            said = str(error)
        finally:
            os.write(writes, said.encode())
            os._exit(0)
    os.close(writes)
    with os.fdopen(reads, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(child, 0)
    server.close()
    closed.chmod(0o700)
    kept = f"this user (uid {asker}) may not reach the socket {path} (Permission denied)"
    # FORBIDDEN, not UNREACHABLE: no wait (`events --follow`, a retry) would let this user in.
    assert said.startswith(f"FORBIDDEN: {kept}" if named else "FORBIDDEN: no broker answers at http://127.0.0.1:"), said
    assert kept in said
    assert "--socket a path every user can reach" in said
    assert "start one" not in said


@pytest.mark.parametrize(
    ("flags", "within", "then"),
    [
        ([], "0.5s", "a lease granted later has no holder to give it back, and lives until its TTL runs out"),
        (["--wait", "1s"], "1.5s", "a lease granted later has no holder to give it back"),
        (["--wait", "forever", "--deadline", "2000-01-01T00:00:00Z"], "0.5s", "lives until its TTL runs out"),
        (["--", "true"], "0.5s", "CMD was not started, and a lease granted later is released once the broker sees this process gone"),
    ],
    ids=["answer-now", "wait", "deadline-passed", "cmd"],
)
def test_a_lease_request_the_broker_takes_and_never_answers_is_given_up_on_after_its_wait(
    tmp_path: Path, monkeypatch: Any, capsys: Any, flags: list[str], within: str, then: str
) -> None:
    """A broker stopped (SIGSTOP, a debugger, a hung disk) still accepts on its socket: a lease asked for without
    --wait waited on it for as long as it was stopped. Its wait in the queue and REQUEST_TIMEOUT more, then it is
    given up on, saying what becomes of a lease granted later."""
    path = tmp_path / "api.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT", 0.5)
    monkeypatch.setenv("GPUBROKER_URL", f"unix:{path}")
    never = threading.Timer(20.0, server.close)  # a request never given up on ends here, unanswered, not in a hung test
    never.start()
    try:
        assert cli.main(["lease", "--gpu-memory", "1GiB", *flags]) == 1
    finally:
        never.cancel()
        server.close()
    said = capsys.readouterr().err
    assert f"gpubroker: TIMEOUT: the broker at unix:{path} did not answer POST /v1/leases within {within} " in said
    assert then in said


def test_a_lease_that_waits_forever_waits_for_its_answer_as_long_as_the_broker_takes(tmp_path: Path, monkeypatch: Any) -> None:
    """--wait forever: the broker keeps the request until room is free, however long; it is never given up on."""
    path = tmp_path / "api.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT", 0.2)
    monkeypatch.setenv("GPUBROKER_URL", f"unix:{path}")
    lease = {"id": "l-1", "state": "granted", "epoch": 1, "gpus": [], "expires_at": "2026-01-01T00:00:00.000Z", "token": "t", "env": {}}

    def answer_late() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            time.sleep(1.0)  # five times REQUEST_TIMEOUT: a wait in the queue
            body = json.dumps({"lease": lease}).encode()
            conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    taker = threading.Thread(target=answer_late)
    taker.start()
    try:
        assert cli.main(["lease", "--gpu-memory", "1GiB", "--wait", "forever", "--json"]) == 0
    finally:
        taker.join(5)
        server.close()


def test_a_broker_that_takes_a_request_and_never_answers_is_given_up_on_and_a_slow_one_is_waited_for(tmp_path: Path) -> None:
    """A stopped broker (SIGSTOP) still accepts on its socket: without a timeout, `gpubroker lease` waited on it
    for as long as it was stopped. A slow one (a commit waiting 10-25 ms for a busy disk) is no stopped one."""
    path = tmp_path / "api.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    answer = threading.Event()

    def take(delay: float | None) -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            if delay is None:
                answer.wait(10)  # never answers while the client waits
                return
            time.sleep(delay)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")

    client = Client(Endpoint(f"unix:{path}"), timeout=None)
    try:
        taker = threading.Thread(target=take, args=(None,))
        taker.start()
        with pytest.raises(ClientError) as silent:
            client.call("POST", "/v1/leases/l-1/renew", timeout=cli._patience(1.0))
        answer.set()
        taker.join(5)
        assert silent.value.code == "TIMEOUT"
        assert (
            silent.value.message
            == f"the broker at unix:{path} did not answer POST /v1/leases/l-1/renew within 1s (stopped, or far too busy)"
        )
        taker = threading.Thread(target=take, args=(0.05,))  # twice the slowest commit on a busy disk
        taker.start()
        assert client.call("POST", "/v1/leases/l-1/renew", timeout=cli._patience(1.0)) == {}
        taker.join(5)
    finally:
        server.close()
    assert (cli._patience(1.0), cli._patience(6.0), cli._patience(300.0)) == (1.0, 2.0, 10.0)


async def test_each_event_is_one_line_of_gpubroker_events_whatever_its_message_holds(tmp_path: Path) -> None:
    """A driver's error with a line break (a simulation file's `unreadable`, a peer's refusal) printed as two lines, the
    second with no seq or type, and an escape sequence in it acted on the terminal."""
    clock = FakeClock(1_800_000_000.0)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        broker.apply_sample(None, "GPU is lost\n\x1b[2Jwhole screen cleared")
        await broker.store.commit([])
        events, _ = broker.events(0, 100)
    finally:
        await broker.close()
    (line,) = [cli._event_line(e) for e in events if e["type"] == "gpu.driver_error"]
    assert line.endswith(" gpu.driver_error DRIVER_ERROR: GPUs cannot be read: GPU is lost\\x0a\\x1b[2Jwhole screen cleared")


async def test_events_follow_onto_a_broker_on_another_store_prints_its_events_from_the_first_and_says_so(
    tmp_path: Path, monkeypatch: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resumed after the last seq printed, a follower skipped the first events of a broker started again on a new or
    wiped store (its broker.started among them), numbered from 1 again, without a word."""
    monkeypatch.setattr(cli, "FOLLOW_EVERY", 0.02)
    path = tmp_path / "api.sock"
    monkeypatch.setenv("GPUBROKER_URL", f"unix:{path}")
    clock = FakeClock(1_800_000_000.0)

    async def serve(state: str, recorded: int) -> tuple[Broker, web.AppRunner]:
        """A broker on `state` that has recorded `recorded` events after its broker.started, before it answers."""
        config = Config(state_dir=tmp_path / state, name="tower")
        broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
        await broker.start()
        for _ in range(recorded):
            broker.record_event(f"test.{state}", f"on the store in {state}")
        await broker.store.commit([])
        runner = web.AppRunner(make_app(broker))
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        return broker, runner

    async def stop(broker: Broker, runner: web.AppRunner) -> None:
        await runner.cleanup()
        await broker.close()

    printed: list[str] = []
    said: list[str] = []

    async def printed_until(count: int) -> None:
        for _ in range(150):  # 3 s
            out, err = capsys.readouterr()
            printed.extend(out.splitlines())
            said.extend(err.splitlines())
            if len(printed) >= count:
                return
            await asyncio.sleep(0.02)

    serving = await serve("first", 1)
    args = argparse.Namespace(after=0, follow=True, json=False)
    follower = threading.Thread(target=cli.cmd_events, args=(args,))
    follower.start()
    try:
        await printed_until(2)
        await stop(*serving)
        serving = await serve("first", 0)  # started again on the same store: its events go on from 3
        await printed_until(3)
        await stop(*serving)
        serving = await serve("wiped", 4)  # its newest, 5, is past the last printed: seqs alone would not tell
        await printed_until(8)
    finally:
        args.follow = False  # it returns after its next answer
        await asyncio.to_thread(follower.join, 5)
        await stop(*serving)
    seqs_and_types = [(line.split()[0], line.split()[2].rstrip(":")) for line in printed]
    assert seqs_and_types == [
        ("1", "broker.started"), ("2", "test.first"), ("3", "broker.started"),
        ("1", "broker.started"), *((str(seq), "test.wiped") for seq in range(2, 6)),
    ]  # fmt: skip
    another = [line for line in said if "another store" in line]
    assert len(another) == 1
    assert another[0].endswith(", which numbers them from 1 again; printing its events from the first")
    # A broker that names no store is told by its newest event, below the last one printed.
    assert cli._another_store("", {"events": [], "next": 2}, 3) == (
        "the broker's newest event is 2, below the 3 printed: it keeps its events in another store"
    )


def test_cmd_under_a_lease_of_no_gpu_memory_is_not_given_an_inherited_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpubroker lease --gpu-memory 2GiB -- gpubroker lease --cpu-cores 1 -- CMD`: the inner CMD saw the outer lease's
    GPUBROKER_GPU_MEMORY beside its own empty CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("GPUBROKER_GPU_MEMORY", "2147483648")
    env = cli._child_env({"GPUBROKER_LEASE": "l-1", "CUDA_VISIBLE_DEVICES": ""})
    assert "GPUBROKER_GPU_MEMORY" not in env
    assert cli._child_env({"GPUBROKER_GPU_MEMORY": "1024"})["GPUBROKER_GPU_MEMORY"] == "1024"
