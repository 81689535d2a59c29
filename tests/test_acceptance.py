"""The single-node story as a user lives it: a real broker process, a simulation file, the CLI and the API."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BrokerProcess, free_port, wait_for

from gpubroker.client import Client, ClientError, Endpoint

GIB = 2**30
SIMULATION = """
[[gpu]]
name = "NVIDIA GeForce RTX 4090"
memory = "24GiB"

[[process]]
gpu = 0
pid = 900001
name = "ollama"
used = "{used}"
"""


def simulation_file(tmp_path: Path, used: str = "6GiB") -> Path:
    """The README's simulation file: one 24 GiB GPU, and ollama using `used` of it."""
    sim = tmp_path / "gpus.toml"
    sim.write_text(SIMULATION.format(used=used))
    return sim


def test_external_usage_from_the_simulation_file_drives_the_figures_and_the_decisions(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    sim = simulation_file(tmp_path)
    broker = broker_process(str(sim)).start()
    client = broker.client()

    figures = client.call("GET", "/v1/node")["gpus"][0]["figures"]
    assert (figures["total"], figures["external"], figures["reserve"], figures["schedulable"]) == (24 * GIB, 6 * GIB, 1 * GIB, 17 * GIB)

    with pytest.raises(ClientError) as refused:
        client.call("POST", "/v1/leases", {"gpu_memory": "18GiB", "bind": "none"})
    assert refused.value.status == 409
    assert refused.value.code == "INSUFFICIENT_SCHEDULABLE_VRAM"
    assert "24.0 GiB): 6.0 external (ollama 6.0), 0.0 leased, 1.0 reserve → 17.0 schedulable; needs 18.0" in refused.value.message

    lease = client.call("POST", "/v1/leases", {"gpu_memory": "16GiB", "bind": "none"})["lease"]
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-sim-0"

    sim.write_text(SIMULATION.format(used="9GiB"))

    def pressure_reported() -> bool:
        events = client.call("GET", "/v1/events", query={"after": 0, "limit": 1000})["events"]
        return any(e["type"] == "gpu.pressure.started" and e.get("code") == "EXTERNAL_GPU_PRESSURE" for e in events)

    wait_for(pressure_reported, timeout=10)
    gpu = client.call("GET", "/v1/node")["gpus"][0]
    assert gpu["figures"]["schedulable"] == 0
    assert gpu["figures"]["external"] == 9 * GIB
    assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "granted"

    client.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
    figures = client.call("GET", "/v1/node")["gpus"][0]["figures"]
    assert (figures["leased"], figures["schedulable"]) == (0, 14 * GIB)


def test_status_shows_every_gpu_and_the_host_budgets(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("2x24GiB").start()
    shown = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=broker.env, capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert "GPU 0  Simulated GPU  GPU-sim-0" in shown.stdout
    assert "GPU 1  Simulated GPU  GPU-sim-1" in shown.stdout
    assert "total 24.0  observed 0.0  external 0.0  resident 0.0  leased 0.0  reserve 1.0  schedulable 23.0 GiB" in shown.stdout
    assert "CPU " in shown.stdout
    assert "memory " in shown.stdout


def test_a_printed_lease_lives_by_its_ttl_and_is_listed_and_released_from_the_cli(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpubroker", *args], env=broker.env, capture_output=True, text=True, timeout=30)

    granted = cli("lease", "--gpu-memory", "10GiB", "--priority", "background", "--name", "train", "--json")
    assert granted.returncode == 0, granted.stderr
    assert '"bind": "none"' in granted.stdout
    printed = cli("lease", "--cpu-cores", "1", "--memory", "1GiB")  # it said "granted: no GPU", not what it holds
    assert re.match(r"lease l-\w+ granted: 1 CPU core, 1\.0 GiB memory; lease epoch 2; expires ", printed.stdout), printed
    listing = cli("leases")
    assert "background" in listing.stdout
    assert "train" in listing.stdout
    lease_id = next(line.split()[0] for line in listing.stdout.splitlines() if "train" in line)
    released = cli("release", lease_id)
    assert released.returncode == 0, released.stderr
    assert f"lease {lease_id} released" in released.stdout
    events = cli("events")
    assert "lease.granted" in events.stdout
    assert "lease.released" in events.stdout
    for listing in (["events"], ["leases", "--json"], ["status"]):  # `gpubroker events | head -1`, its reader gone at once
        piped = subprocess.Popen(
            [sys.executable, "-m", "gpubroker", *listing], env=broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert piped.stdout is not None
        piped.stdout.close()
        _, stderr = piped.communicate(timeout=30)
        assert (piped.returncode, stderr) == (141, b""), listing
    held = cli("lease", "--gpu-memory", "10GiB", "--json")
    refused = cli("lease", "--gpu-memory", "20GiB")
    assert refused.returncode == 75
    assert "INSUFFICIENT_SCHEDULABLE_VRAM" in refused.stderr
    negative = cli("lease", "--memory", "1MiB", "--ttl", "-5s")  # a value, not a flag: the broker says why not
    assert (negative.returncode, negative.stderr.split(":")[1].strip()) == (1, "INVALID_REQUEST"), negative.stderr
    assert "ttl" in negative.stderr
    never = cli("lease", "--gpu-memory", "30GiB", "--wait", "forever")
    assert never.returncode == 75
    assert "CAPABILITY_UNAVAILABLE" in never.stderr
    assert json.loads(held.stdout)["state"] == "granted"
    waiting = subprocess.Popen(
        [sys.executable, "-m", "gpubroker", "lease", "--gpu-memory", "20GiB", "--wait", "5m"],
        env=broker.env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: broker.client().call("GET", "/v1/leases", query={"state": "queued"})["leases"], timeout=20.0)
    [queued] = broker.client().call("GET", "/v1/leases", query={"state": "queued"})["leases"]
    cancelled = cli("release", queued["id"])  # releasing a request that waits cancels it: done, not a failure
    assert (cancelled.returncode, cancelled.stdout) == (0, f"request {queued['id']} cancelled: it was waiting and had no lease yet\n")
    assert waiting.wait(30) == 75
    for odd in ("a b", "l-1?state=granted", "../healthz"):  # an id is one path segment, whatever it holds
        unknown = cli("release", odd)
        assert (unknown.returncode, unknown.stderr.split(":")[1].strip()) == (1, "NOT_FOUND"), unknown.stderr


def test_a_listing_with_its_standard_output_closed_says_it_could_not_be_written_and_fails(broker_process: type[BrokerProcess]) -> None:
    """`gpubroker status >&-` printed nothing and exited 0, as if all was well, and `events --follow >&-` followed
    events into nowhere for ever: a closed standard output now fails as a full disk does."""
    broker = broker_process("1x24GiB").start()
    for listing in (["status"], ["leases", "--json"], ["events"], ["events", "--follow", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "gpubroker", *listing],
            env=broker.env,
            stdout=None,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
            preexec_fn=lambda: os.close(1),
        )
        assert (done.returncode, done.stderr) == (1, "gpubroker: the output could not be written: standard output is closed\n"), listing


def test_events_lists_every_kept_event_and_as_json_one_document(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    client = broker.client()
    for _ in range(520):  # more events than one page of the API
        lease = client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})["lease"]
        client.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
    kept, after = [], 0
    while page := client.call("GET", "/v1/events", query={"after": after, "limit": 1000})["events"]:
        kept += [event["seq"] for event in page]
        after = kept[-1]
    assert len(kept) > 1000
    run = [sys.executable, "-m", "gpubroker", "events"]
    lines = subprocess.run(run, env=broker.env, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    listed = json.loads(subprocess.run([*run, "--json"], env=broker.env, capture_output=True, text=True, timeout=30, check=True).stdout)
    assert [event["seq"] for event in listed] == kept
    assert len(lines) == len(kept)


def test_a_broker_restarted_on_its_state_keeps_its_leases(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    lease = broker.client().call("POST", "/v1/leases", {"gpu_memory": "4GiB", "bind": "none"})["lease"]
    broker.stop()
    broker.start()
    kept = broker.client().call("GET", f"/v1/leases/{lease['id']}")["lease"]
    assert (kept["state"], kept["epoch"]) == ("granted", lease["epoch"])


def test_a_second_broker_on_the_same_state_refuses_to_start(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    second = subprocess.run(
        [sys.executable, "-m", "gpubroker", "up", "--state", str(broker.state), "--socket", str(broker.socket) + "2",
         "--listen", "127.0.0.1:0", "--simulate-gpus", "1x24GiB"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert second.returncode == 2
    assert "another broker is running on" in second.stderr
    assert "stop it first, or give --state another directory for a broker of its own" in second.stderr


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", "up", "--simulate-gpus", "1x24GiB", *args], capture_output=True, text=True, timeout=30
    )


def test_a_broker_refused_the_socket_another_answers_on_leaves_that_socket_alone(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_process("1x24GiB").start()
    refused = _up("--state", str(tmp_path / "other"), "--socket", str(broker.socket), "--listen", "127.0.0.1:0")
    assert refused.returncode == 2, refused.stderr
    assert "another broker answers on" in refused.stderr
    assert broker.client().call("GET", "/healthz")["ok"]  # its socket is still there, and still its own


def test_up_refuses_what_it_cannot_use_in_one_line_and_removes_nothing(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("kept\n")
    a_file = tmp_path / "afile"
    a_file.write_text("")
    a_dir = tmp_path / "adir"
    a_dir.mkdir()
    config = tmp_path / "huge.toml"
    config.write_text('store_size = "99999TiB"\n')
    state, sock = str(tmp_path / "state"), str(tmp_path / "api.sock")
    for args, said in [
        (["--state", state, "--socket", str(precious)], "exists and is not a socket"),
        (["--state", state, "--socket", str(a_dir)], "exists and is not a socket"),
        (["--state", state, "--socket", str(tmp_path / ("s" * 120))], "a Unix socket's is at most 107"),
        (["--state", str(a_file), "--socket", sock], "cannot use"),
        (["--state", state, "--socket", sock, "--config", str(config)], "cannot open the state store"),
    ]:
        refused = _up(*args, "--listen", "127.0.0.1:0")
        assert (refused.returncode, "Traceback" in refused.stderr) == (2, False), refused.stderr
        assert refused.stderr.startswith("gpubroker: "), refused.stderr
        assert said in refused.stderr, refused.stderr
    assert precious.read_text() == "kept\n"
    assert a_dir.is_dir()


def _cut_short(data: Path, lease_id: str) -> None:
    os.truncate(data, 2 * 4096)  # its two header pages, none of the pages they point to


def _overwrite_the_lease_pages(data: Path, lease_id: str) -> None:
    content = bytearray(data.read_bytes())
    pages = {at // 4096 for at in range(len(content)) if content.startswith(lease_id.encode(), at)}
    for page in pages:
        content[page * 4096 : (page + 1) * 4096] = b"\xa5" * 4096
    data.write_bytes(bytes(content))


@pytest.mark.parametrize("damage", [_cut_short, _overwrite_the_lease_pages], ids=["cut-short", "page-overwritten"])
def test_a_damaged_store_is_refused_in_one_line_and_left_as_it_was(
    broker_process: type[BrokerProcess], tmp_path: Path, damage: Callable[[Path, str], None]
) -> None:
    broker = broker_process("1x24GiB").start()
    lease = broker.client().call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none", "ttl": "1h"})["lease"]
    broker.stop()
    data = broker.state / "store" / "data.mdb"
    damage(data, lease["id"])
    damaged = data.read_bytes()

    refused = _up("--state", str(broker.state), "--socket", str(broker.socket), "--listen", "127.0.0.1:0")
    assert (refused.returncode, "Traceback" in refused.stderr) == (2, False), refused.stderr
    assert refused.stderr.startswith(f"gpubroker: the state store in {broker.state / 'store'} is damaged"), refused.stderr
    assert "restore" in refused.stderr, refused.stderr
    assert data.read_bytes() == damaged  # nothing was written over the leases it may still hold


def test_a_command_run_under_a_lease_gets_the_terminal_like_a_shell_job(broker_process: type[BrokerProcess]) -> None:
    import fcntl
    import os
    import pty
    import termios

    broker = broker_process("1x24GiB").start()
    master, slave = pty.openpty()

    def own_terminal() -> None:  # a new session whose controlling terminal is the pty, as a login shell's job
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    probe = "import os; print('foreground', os.tcgetpgrp(0) == os.getpgrp(), flush=True)"
    run = subprocess.Popen(
        [sys.executable, "-m", "gpubroker", "lease", "--gpu-memory", "1GiB", "--", sys.executable, "-c", probe],
        env=broker.env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=own_terminal,
    )  # fmt: skip
    os.close(slave)
    try:
        assert run.wait(30) == 0
        output = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the pty is closed once every holder of its slave has exited
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
        if run.poll() is None:
            run.kill()
    assert b"foreground True" in output, output


def test_init_refuses_a_state_directory_a_broker_is_running_on(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    init = [sys.executable, "-m", "gpubroker", "init", "--state", str(broker.state)]
    refused = subprocess.run(init, env=broker.env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2, refused.stderr
    assert "another broker is running" in refused.stderr
    assert "stop it" in refused.stderr
    broker.stop()
    made = subprocess.run(init, env=broker.env, capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr


def test_token_with_a_mistyped_state_directory_makes_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "no-such-state"
    answer = subprocess.run([sys.executable, "-m", "gpubroker", "token", "--state", str(typo)], capture_output=True, text=True, timeout=30)
    assert answer.returncode == 2
    assert "no state directory" in answer.stderr
    assert not typo.exists()


def test_token_whose_reader_goes_away_or_whose_disk_is_full_says_so_as_every_command(tmp_path: Path) -> None:
    """`gpubroker token | head -c 8` said `gpubroker: [Errno 32] Broken pipe` and exited 2, as if the token could not
    be read; a full disk gave Python's errno too. A token that cannot be read is one line naming the directory."""
    state = tmp_path / "state"
    state.mkdir()
    token = [sys.executable, "-m", "gpubroker", "token", "--state", str(state)]
    piped = subprocess.Popen(token, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert piped.stdout is not None
    piped.stdout.close()  # the reader gone before a word is written
    _, stderr = piped.communicate(timeout=30)
    assert (piped.returncode, stderr) == (141, b"")
    with open("/dev/full", "w") as full:
        done = subprocess.run(token, stdout=full, stderr=subprocess.PIPE, text=True, timeout=30)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "gpubroker: the output could not be written: No space left on device"
    other = tmp_path / "other"
    (other / "ui").mkdir(parents=True)
    (other / "ui" / "api_token").mkdir()  # not a file: the token cannot be read from it
    unreadable = subprocess.run([*token[:-1], str(other)], capture_output=True, text=True, timeout=30)
    assert (unreadable.returncode, unreadable.stdout) == (2, "")
    assert unreadable.stderr.startswith(f"gpubroker: cannot read the API token in {other}: Is a directory;"), unreadable.stderr


def test_a_stopped_broker_answers_its_waiting_requests_at_once_and_exits_promptly(broker_process: type[BrokerProcess]) -> None:
    """SIGTERM (systemd's stop) with a request waiting forever: the broker must not hang until the wait ends."""
    import threading

    broker = broker_process("1x8GiB").start()
    client = broker.client()
    client.call("POST", "/v1/leases", {"gpu_memory": "7GiB", "bind": "none"})
    answers: list[ClientError] = []

    def wait_forever() -> None:
        try:
            client.call("POST", "/v1/leases", {"gpu_memory": "1GiB", "wait": "1000h", "bind": "none"})
        except ClientError as error:
            answers.append(error)

    waiting = threading.Thread(target=wait_forever)
    waiting.start()
    wait_for(lambda: len(client.call("GET", "/v1/leases", query={"state": "queued"})["leases"]) == 1, 10)
    assert broker.proc is not None
    broker.proc.terminate()
    assert broker.proc.wait(10) == 0  # far sooner than the wait, and than systemd's TimeoutStopSec
    waiting.join(10)
    (stopped,) = answers
    assert (stopped.code, stopped.details.get("stopping")) == ("LEASE_TIMEOUT", True)
    assert "is stopping; ask again once it is back" in stopped.message


def test_the_cli_never_prints_a_control_character_it_was_given(broker_process: type[BrokerProcess], tmp_path: Path) -> None:
    """A name can reach the CLI from outside a request's checks (a process's own name, an older node's document):
    printed, its ESC or CR must not act on the operator's terminal."""
    sim = tmp_path / "gpus.toml"
    sim.write_text(SIMULATION.format(used="6GiB").replace('name = "ollama"', 'name = "evil\\u001b[2J\\rforged\\nline"'))
    broker = broker_process(str(sim)).start()
    status = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=broker.env, capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "evil\\x1b[2J\\x0dforged\\x0aline: 6.0 GiB (external)" in status.stdout  # a line feed forged a line too
    assert "\x1b" not in status.stdout
    assert "\r" not in status.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "gpubroker", "status", "--json"], env=broker.env, capture_output=True, text=True, timeout=30
    )
    assert json.loads(as_json.stdout)["node"]["gpus"][0]["processes"][0]["name"] == "evil\x1b[2J\rforged\nline"  # JSON escapes it itself


def test_leases_keeps_its_columns_aligned_on_a_terminal_with_wide_and_combining_characters_in_holder_names(
    broker_process: type[BrokerProcess],
) -> None:
    """A CJK name takes two columns a character, a combining accent none: padded by characters, every column after
    the holder's was pushed right on the line of a Japanese name, and left on the line of a decomposed "é"."""
    broker = broker_process("1x24GiB").start()
    for name in ("日本語の長い名前", "cafe\u0301-train", "plain"):
        broker.client().call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none", "holder": {"name": name}})
    env = {**broker.env, "LC_ALL": "C"}
    env.pop("PYTHONIOENCODING", None)
    listing = subprocess.run([sys.executable, "-m", "gpubroker", "leases"], env=env, capture_output=True, text=True, timeout=30)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert len(lines) == 4, lines

    def column_of(line: str, text: str) -> int:
        """The terminal column where `text` starts on a line (East Asian wide characters take two)."""
        before = line[: line.index(text)]
        return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) == "W" else 1 for c in before)

    assert {column_of(line, "0:1.0") for line in lines[1:]} == {column_of(lines[0], "GPUS")}, listing.stdout


def test_events_follow_waits_through_a_broker_restart_and_goes_on(broker_process: type[BrokerProcess], tmp_path: Path) -> None:
    broker = broker_process("1x24GiB").start()
    log = tmp_path / "follow.log"
    with log.open("wb") as out:
        follower = subprocess.Popen([sys.executable, "-m", "gpubroker", "events", "--follow"], env=broker.env, stdout=out, stderr=out)
    try:
        wait_for(lambda: "broker.started" in log.read_text(), timeout=20.0)
        broker.stop()
        wait_for(lambda: "waiting for it to answer again" in log.read_text(), timeout=20.0)
        assert follower.poll() is None  # it waits, as `tail -F` does for a file that comes back
        broker.start()
        wait_for(lambda: log.read_text().count("broker.started") == 2, timeout=20.0)
        said = log.read_text()
        assert said.count("waiting for it to answer again") == 1  # said once, not every second
        assert "the broker answers again" in said
    finally:
        follower.terminate()
        follower.wait(10)


def test_a_broker_listening_on_an_ipv6_address_given_bare_says_the_url_a_client_takes(broker_process: type[BrokerProcess]) -> None:
    """`up --listen ::1:PORT` said `API on http://::1:PORT`, which GPUBROKER_URL refuses; and the client's refusal of
    that URL did not say what was wrong with it."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    broker = broker_process("1x24GiB")
    broker.extra = ["--listen", f"::1:{broker.port}"]
    broker.start()
    url = f"http://[::1]:{broker.port}"
    assert f" and {url};" in broker.ready_line
    env = {**broker.env, "GPUBROKER_URL": url}
    status = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=env, capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    bare = {**env, "GPUBROKER_URL": f"http://::1:{broker.port}"}
    refused = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=bare, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1
    assert refused.stderr.endswith("(an IPv6 address goes in brackets: http://[::1]:9740)\n"), refused.stderr


def test_a_broker_told_to_listen_on_port_0_says_the_port_it_got(broker_process: type[BrokerProcess]) -> None:
    """`up --listen 127.0.0.1:0` served on a port the kernel picked and said `API on http://127.0.0.1:0`: nobody could
    tell where it was."""
    broker = broker_process("1x24GiB")
    broker.extra = ["--listen", "127.0.0.1:0"]
    broker.start()
    said = re.search(r" and http://127\.0\.0\.1:(\d+);", broker.ready_line)
    assert said is not None, broker.ready_line
    assert int(said[1]) != 0, broker.ready_line
    env = {**broker.env, "GPUBROKER_URL": f"http://127.0.0.1:{said[1]}"}
    status = subprocess.run([sys.executable, "-m", "gpubroker", "status", "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert [gpu["uuid"] for gpu in json.loads(status.stdout)["cluster"]["nodes"][0]["gpus"]] == ["GPU-sim-0"]


def test_a_client_that_finds_no_broker_where_it_looks_says_where_it_looked(broker_process: type[BrokerProcess], tmp_path: Path) -> None:
    """With a broker running on a socket and port of its own and no GPUBROKER_URL, the CLI said only that nothing
    answers at http://127.0.0.1:9740, and to start a broker: it never named the sockets it looked at first, nor how
    to name the broker that runs."""
    broker = broker_process("1x24GiB").start()
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    env = {k: v for k, v in broker.env.items() if k != "GPUBROKER_URL"} | {"XDG_RUNTIME_DIR": str(runtime)}
    lost = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=env, capture_output=True, text=True, timeout=30)
    if lost.returncode == 0:
        pytest.skip("a broker answers at this machine's default socket or address")
    assert lost.returncode == 1
    # Root's own socket is the system's, whatever its XDG_RUNTIME_DIR: looked at once.
    looked = "/run/gpubroker/api.sock" if os.geteuid() == 0 else f"{runtime}/gpubroker/api.sock or /run/gpubroker/api.sock"
    assert f"nor on {looked};" in lost.stderr, lost.stderr
    assert "GPUBROKER_URL (unix:PATH, its --socket, or http://HOST:PORT, its --listen)" in lost.stderr
    assert len(lost.stderr.splitlines()) == 1


def test_a_broker_url_naming_a_user_and_password_is_refused_without_saying_the_password(tmp_path: Path) -> None:
    """`http://alice:s3cret@127.0.0.1:9740` was taken whole for the host: "no broker answers at
    http://alice:s3cret@... (Name or service not known)" put the password on the terminal and said nothing useful."""
    env = {**os.environ, "GPUBROKER_URL": "http://alice:s3cret@127.0.0.1:9"}
    refused = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1
    assert "s3cret" not in refused.stderr
    assert refused.stderr.startswith("gpubroker: INVALID_REQUEST: GPUBROKER_URL names a user (USER@HOST)"), refused.stderr
    assert "GPUBROKER_TOKEN" in refused.stderr


def test_a_broker_url_naming_something_other_than_a_socket_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpubroker", "status"],
        env={**os.environ, "GPUBROKER_URL": f"unix:{tmp_path}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert f"{tmp_path} is not a socket: give the broker's --socket in GPUBROKER_URL" in done.stderr, done.stderr


def test_the_log_says_when_the_gpus_cannot_be_read_and_when_they_can_again_and_why_the_broker_stops(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """A service's journal is its standard error: what changes the broker's ability to decide is there, not only in events."""
    sim = simulation_file(tmp_path)
    broker = broker_process(str(sim)).start()
    sim.write_text("[[gpu]]\nmemory = ")
    wait_for(lambda: any("gpubroker: GPUs cannot be read:" in line for line in broker.output), timeout=10)
    sim.write_text(SIMULATION.format(used="6GiB"))
    wait_for(lambda: any(line == "gpubroker: GPUs can be read again\n" for line in broker.output), timeout=10)
    broker.stop()
    wait_for(lambda: broker.output[-1:] == ["gpubroker: stopped\n"], timeout=5)  # read to its end
    assert broker.output[-2:] == ["gpubroker: SIGTERM: stopping\n", "gpubroker: stopped\n"], broker.output
    assert sum("cannot be read" in line for line in broker.output) == 1  # said at the change, not at every sample


def test_settings_that_cannot_do_what_they_say_are_warned_of_at_start(broker_process: type[BrokerProcess], tmp_path: Path) -> None:
    config = tmp_path / "gpubroker.toml"
    config.write_text('reserve = "30GiB"\nstore_size = "1MiB"\n[[stamp]]\npriority = "production"\nuser = "no-such-user-here"\n')
    broker = broker_process("1x24GiB", extra=["--config", str(config)]).start()
    wait_for(lambda: sum("gpubroker: warning:" in line for line in broker.output) == 3, timeout=5)
    warned = [line for line in broker.output if "gpubroker: warning:" in line]
    assert warned == [
        "gpubroker: warning: [[stamp]] user 'no-such-user-here' is no user of this machine: that stamp never applies\n",
        "gpubroker: warning: store_size (1.0 MiB) may be filled by the history it keeps (leases_kept 1000, events_kept 10000) "
        "before any is dropped: give it 12 MiB or more, or keep less\n",
        "gpubroker: warning: reserve (30.0 GiB) is as large as every GPU: no GPU memory can be leased\n",
    ]


def test_a_broker_whose_log_nobody_reads_any_more_goes_on_and_still_stops_on_sigterm(tmp_path: Path) -> None:
    """`gpubroker up 2>&1 | tee log`, and tee gone: a line the broker cannot write is lost, never the broker."""
    sim = simulation_file(tmp_path)
    sock = tmp_path / "api.sock"
    argv = [sys.executable, "-m", "gpubroker", "up", "--state", str(tmp_path / "state"), "--socket", str(sock)]
    broker = subprocess.Popen(
        [*argv, "--listen", f"127.0.0.1:{free_port()}", "--simulate-gpus", str(sim)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert broker.stdout is not None
        assert broker.stdout.readline().startswith(b"gpubroker ready")
        broker.stdout.close()  # the reader is gone
        sim.write_text("[[gpu]]\nmemory = ")  # a change the log would say
        client = Client(Endpoint(f"unix:{sock}"))
        wait_for(lambda: client.call("GET", "/v1/node")["driver_error"] is not None, timeout=10)
        sim.write_text(SIMULATION.format(used="6GiB"))
        wait_for(lambda: client.call("GET", "/v1/node")["driver_error"] is None, timeout=10)
        assert broker.poll() is None
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(10) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait(10)


def test_events_asked_for_from_a_point_no_longer_kept_say_how_many_were_dropped(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    config = tmp_path / "gpubroker.toml"
    config.write_text("events_kept = 100\n")
    broker = broker_process("1x24GiB", extra=["--config", str(config)]).start()
    client = broker.client()
    for _ in range(120):
        lease = client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})["lease"]
        client.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
    answer = client.call("GET", "/v1/events", query={"after": 3, "limit": 10})
    first = answer["events"][0]["seq"]
    assert first > 4
    assert answer["dropped"] == first - 4
    assert client.call("GET", "/v1/events", query={"after": first, "limit": 10})["dropped"] == 0
    listed = subprocess.run(
        [sys.executable, "-m", "gpubroker", "events", "--after", "3"], env=broker.env, capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0
    assert f"gpubroker: {first - 4} events after 3 are no longer kept (events_kept): from {first} on" in listed.stderr


def test_a_broker_whose_gpu_reading_hangs_answers_on_refuses_gpus_as_stale_and_still_stops(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """A driver call stuck in the kernel (NVML and a GPU falling off the bus) hangs the thread that reads the GPUs: the
    broker answers on, decides nothing on the old reading, and stops on SIGTERM instead of waiting for that thread."""
    import contextlib
    import threading

    config = tmp_path / "gpubroker.toml"
    config.write_text('sample_interval = "200ms"\nstaleness = "1s"\n')
    sim = tmp_path / "gpus.toml"
    os.mkfifo(sim)  # each reading opens it and waits there until it is written: a reading that hangs on demand
    hang = threading.Event()

    def feed() -> None:
        while not hang.is_set():
            with contextlib.suppress(BrokenPipeError), sim.open("w") as out:  # a reader gone at once: the test's end
                # A reading may span several of these writes: GPUs alone, so that any number of copies is still a machine.
                out.write('[[gpu]]\nmemory = "24GiB"\n')

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        broker = broker_process(str(sim), extra=["--config", str(config)]).start()
        hang.set()
        client = broker.client()
        wait_for(lambda: client.call("GET", "/v1/node")["gpus"][0]["stale"], timeout=10)
        with pytest.raises(ClientError) as refused:
            client.call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none"})
        assert refused.value.code == "SCHEDULER_STATE_STALE"
        assert client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})["lease"]["state"] == "granted"
        assert broker.proc is not None
        broker.proc.terminate()
        assert broker.proc.wait(10) == 0  # it waited for the stuck reading: for ever, or until systemd's SIGKILL
    finally:
        hang.set()
        os.close(os.open(sim, os.O_RDONLY | os.O_NONBLOCK))  # a feeder still waiting for a reader writes once more and ends
        feeder.join(10)
