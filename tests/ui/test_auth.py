"""Safe on a LAN: the UI password, sessions, CSRF tokens, Host and Origin checks, the API token and HTTPS.

The rules are tested in process (a real broker and store behind aiohttp's test server,
reached over TCP), then once as a user meets them: a broker told to listen beyond
loopback refuses without a password, and with one serves HTTPS that the CLI reaches
with GPUBROKER_URL, GPUBROKER_TOKEN and GPUBROKER_CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import BrokerProcess, free_port
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.config import Config, ConfigError, load_config
from gpubroker.ui import pages, stream
from gpubroker.ui.api import MESH, make_app
from gpubroker.ui.auth import (
    SESSION_COOKIE,
    Guard,
    PasswordError,
    Sessions,
    api_token_path,
    hash_password,
    load_or_create_api_token,
    parse_hash,
    verify_password,
)
from gpubroker.ui.pages import SignIns

PASSWORD = "correct horse battery"
TOKEN = "node-api-token-for-tests"
FAST = 2**10  # scrypt's cost, small in tests; `gpubroker password` uses 2**14


def test_a_password_hash_verifies_its_password_and_no_other() -> None:
    stored = hash_password(PASSWORD, n=FAST)
    assert stored.startswith(f"scrypt${FAST}$8$1$")
    assert verify_password(PASSWORD, stored)
    assert not verify_password(PASSWORD + " ", stored)
    assert hash_password(PASSWORD, n=FAST) != stored  # salted


@pytest.mark.parametrize(
    "bad", ["", "hunter2", "scrypt$16384$8$1$salt", "scrypt$1000$8$1$c2FsdHNhbHQ$ZGlnZXN0ZGlnZXN0ZGlnZXN0", "md5$1$2$3$4$5"]
)
def test_a_malformed_hash_is_refused_by_name_in_the_config(tmp_path: Path, bad: str) -> None:
    with pytest.raises(PasswordError):
        parse_hash(bad)
    config = tmp_path / "gpubroker.toml"
    config.write_text(f'ui_password_hash = "{bad}"\n')
    with pytest.raises(ConfigError, match="ui_password_hash"):
        load_config(config)


# ----- the rules, in process ---------------------------------------------------------------


async def serve(tmp_path: Path, password: bool) -> tuple[TestClient[Any, Any], Broker]:
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower", ui_password_hash=hash_password(PASSWORD, n=FAST) if password else None)
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    guard = Guard(config.ui_password_hash, TOKEN if password else None, tls=False, sessions=Sessions())
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker, None, guard)))
    await client.start_server()
    return client, broker


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[TestClient[Any, Any], Broker]]:
    client, broker = await serve(tmp_path, password=True)
    try:
        yield client, broker
    finally:
        await client.close()
        await broker.close()


async def sign_in(client: TestClient[Any, Any]) -> str:
    """Sign in through the form; the page's CSRF token."""
    answer = await client.post("/login", data={"password": PASSWORD, "next": "/leases"}, allow_redirects=False)
    assert answer.status == 303
    assert answer.headers["Location"] == "/leases"
    page = await (await client.get("/leases")).text()
    marker = '<meta name="csrf-token" content="'
    assert marker in page
    return page.split(marker, 1)[1].split('"', 1)[0]


async def error_of(answer: Any) -> tuple[int, str]:
    return answer.status, (await answer.json())["error"]["code"]


async def test_without_signing_in_every_page_api_and_metrics_answer_401(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, broker = guarded
    for path in ("/", "/node", "/leases", "/events", "/mesh"):
        answer = await client.get(path)
        assert answer.status == 401, path
        assert 'action="/login"' in await answer.text()  # a person gets the form to sign in
    for path in ("/v1/node", "/v1/leases", "/v1/cluster", "/v1/events", "/v1/stream", "/metrics", "/fragment/cluster", "/openapi.json"):
        assert await error_of(await client.get(path)) == (401, "UNAUTHORIZED"), path
    assert await error_of(await client.post("/v1/leases", json={"gpu_memory": "1GiB"})) == (401, "UNAUTHORIZED")
    assert broker.list_leases(None, 10) == []  # nothing was granted
    assert (await client.get("/static/style.css")).status == 200
    assert (await client.get("/login")).status == 200


async def test_a_wrong_password_gets_401_and_the_right_one_a_strict_http_only_cookie(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, _ = guarded
    wrong = await client.post("/login", data={"password": "guess"}, allow_redirects=False)
    assert wrong.status == 401
    assert "wrong password" in await wrong.text()
    assert SESSION_COOKIE not in wrong.cookies
    right = await client.post("/login", data={"password": PASSWORD, "next": "https://elsewhere.example/"}, allow_redirects=False)
    assert right.status == 303
    assert right.headers["Location"] == "/"  # never sent to another site after signing in
    cookie = right.headers["Set-Cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert "Path=/" in cookie
    assert (await client.get("/")).status == 200


async def test_a_deep_link_is_kept_through_a_wrong_password_and_reached_after_the_right_one(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    client, _ = guarded
    deep = "/leases?state=granted&node=tower"
    form = await (await client.get(deep)).text()
    kept = 'name="next" value="/leases?state=granted&amp;node=tower"'
    assert kept in form
    wrong = await client.post("/login", data={"password": "guess", "next": deep}, allow_redirects=False)
    assert wrong.status == 401
    assert kept in await wrong.text()  # the form shown again still leads where the person meant to go
    right = await client.post("/login", data={"password": PASSWORD, "next": deep}, allow_redirects=False)
    assert right.status == 303
    assert right.headers["Location"] == deep


async def test_a_change_without_the_csrf_token_gets_403_and_changes_nothing(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, broker = guarded
    csrf = await sign_in(client)
    assert await error_of(await client.post("/v1/leases", json={"gpu_memory": "1GiB"})) == (403, "FORBIDDEN")
    assert await error_of(await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": "forged"})) == (
        403,
        "FORBIDDEN",
    )
    assert broker.list_leases(None, 10) == []
    made = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": csrf})
    assert made.status == 201
    lease = (await made.json())["lease"]
    assert await error_of(await client.delete(f"/v1/leases/{lease['id']}")) == (403, "FORBIDDEN")
    assert broker.get(lease["id"])["state"] == "granted"
    released = await client.delete(f"/v1/leases/{lease['id']}", headers={"X-CSRF-Token": csrf})
    assert released.status == 200
    assert (await released.json())["lease"]["reason"] == "released by the web UI of tower"


async def test_a_foreign_host_or_origin_gets_403_forbidden_signed_in_or_not(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, broker = guarded
    assert await error_of(await client.get("/", headers={"Host": "evil.example"})) == (403, "FORBIDDEN")
    csrf = await sign_in(client)
    assert await error_of(await client.get("/v1/node", headers={"Host": "rebound.example:9740"})) == (403, "FORBIDDEN")
    across = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": csrf, "Origin": "http://evil.example"})
    assert await error_of(across) == (403, "FORBIDDEN")
    assert broker.list_leases(None, 10) == []
    own_origin = f"http://{client.server.host}:{client.server.port}"
    same = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": csrf, "Origin": own_origin})
    assert same.status == 201


async def test_a_request_whose_target_names_a_foreign_host_gets_403_whatever_its_host_header_says(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    """In absolute form (`GET http://evil.example/v1/node`) the target's host is the request's host, not Host's
    (RFC 9112 §3.2.2), as aiohttp reads it too: the broker answered such a request for another site as if for itself,
    the way an open proxy does."""
    client, _ = guarded
    own = f"{client.host}:{client.port}"

    def ask(target: str, host: str = own) -> int:
        with socket.create_connection((client.host, client.port), timeout=5) as sock:
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
            return int(sock.recv(65536).split(b" ")[1])

    for foreign in ("http://evil.example/v1/node", f"http://evil.example:{client.port}/v1/node", f"http://{own}@evil.example/v1/node"):
        assert await asyncio.to_thread(ask, foreign) == 403, foreign
    assert await asyncio.to_thread(ask, f"http://{own}/v1/node") == 200
    assert await asyncio.to_thread(ask, "http://localhost/v1/node") == 200
    assert await asyncio.to_thread(ask, f"http://{own}/v1/node", "evil.example") == 403  # and Host is still checked
    assert await asyncio.to_thread(ask, "/v1/node") == 200


async def test_the_api_token_makes_an_admin_without_cookie_or_csrf_and_a_wrong_one_gets_401(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    client, broker = guarded
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert (await client.get("/metrics", headers=bearer)).status == 200
    made = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers=bearer)
    assert made.status == 201
    lease_id = (await made.json())["lease"]["id"]
    assert await error_of(await client.get("/v1/node", headers={"Authorization": "Bearer wrong"})) == (401, "UNAUTHORIZED")
    assert await error_of(await client.delete(f"/v1/leases/{lease_id}", headers={"Authorization": "Basic x"})) == (401, "UNAUTHORIZED")
    released = await client.delete(f"/v1/leases/{lease_id}", headers=bearer)
    assert (await released.json())["lease"]["reason"] == "released by the API token"
    assert broker.get(lease_id)["state"] == "released"


async def test_signing_out_takes_the_csrf_token_and_ends_the_session(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, _ = guarded
    csrf = await sign_in(client)
    assert (await client.post("/logout", data={"csrf": "forged"}, allow_redirects=False)).status == 403
    assert (await client.get("/")).status == 200
    out = await client.post("/logout", data={"csrf": csrf}, allow_redirects=False)
    assert out.status == 303
    assert (await client.get("/")).status == 401


async def test_signing_out_of_a_page_whose_session_has_ended_leads_to_the_sign_in_form(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    client, broker = guarded
    csrf = await sign_in(client)
    assert (await client.post("/logout", data={"csrf": csrf}, allow_redirects=False)).status == 303
    # The sign-out button of another tab, or of a page left open over a restart or past its session's 12 hours.
    out = await client.post("/logout", data={"csrf": csrf}, allow_redirects=False)
    assert out.status == 303
    assert out.headers["Location"] == "/login"
    assert not [event for event in broker.events(0, 100)[0] if event["type"] == "request.refused"]


async def test_no_signed_in_page_is_kept_by_the_browser_so_back_after_signing_out_asks_again(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    client, _ = guarded
    await sign_in(client)
    for path in ("/", "/node", "/leases", "/events", "/mesh", "/fragment/leases"):
        answer = await client.get(path)
        assert answer.status == 200, path
        assert answer.headers.get("Cache-Control") == "no-store", path  # else Back shows it, CSRF token and all


async def test_signed_in_pages_offer_release_and_invite_and_unsigned_ones_say_how(tmp_path: Path) -> None:
    client, broker = await serve(tmp_path, password=False)
    try:
        made = await client.post("/v1/leases", json={"gpu_memory": "1GiB"})
        lease_id = (await made.json())["lease"]["id"]
        page = await (await client.get("/leases")).text()
        assert lease_id in page
        assert 'class="act"' not in page  # nobody signed in on loopback: no buttons, and a line that says how
        assert "ui_password_hash" in page
        assert (await client.post("/login", data={"password": PASSWORD})).status == 403
    finally:
        await client.close()
        await broker.close()
    client, broker = await serve(tmp_path / "guarded", password=True)
    try:
        csrf = await sign_in(client)
        made = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": csrf})
        lease_id = (await made.json())["lease"]["id"]
        page = await (await client.get("/leases")).text()
        assert f'data-method="DELETE" data-url="/v1/leases/{lease_id}"' in page
    finally:
        await client.close()
        await broker.close()


# ----- as a user meets it --------------------------------------------------------------------


def test_a_lan_address_without_a_password_is_refused_at_start_naming_the_setting(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpubroker", "up", "--state", str(tmp_path / "state"), "--socket", str(tmp_path / "api.sock")]
        + ["--listen", f"0.0.0.0:{free_port()}", "--simulate-gpus", "1x24GiB"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "ui_password_hash" in done.stderr
    assert "gpubroker password" in done.stderr


@pytest.mark.parametrize("weak", ["short", " " * 12, "  ab  cd  "])
def test_a_ui_password_of_fewer_than_8_characters_besides_spaces_is_refused(weak: str) -> None:
    made = subprocess.run([sys.executable, "-m", "gpubroker", "password"], input=weak + "\n", capture_output=True, text=True)
    assert made.returncode == 2
    assert "at least 8 characters" in made.stderr
    assert made.stdout == ""


NOTHING_READ = (
    "gpubroker: no password was read: standard input ended before one was given (type it when asked, in a terminal, "
    "or give it as the first line of standard input)\n"
)


@pytest.mark.parametrize("given", ["< /dev/null", "<&-"])
def test_no_password_on_standard_input_is_said_to_be_none_not_one_too_short(given: str) -> None:
    """`gpubroker password </dev/null` said the password needed at least 8 characters; with standard input closed it
    ended in a traceback."""
    made = subprocess.run(["sh", "-c", f'exec "$0" -m gpubroker password {given}', sys.executable], capture_output=True, text=True)
    assert (made.returncode, made.stderr, made.stdout) == (2, NOTHING_READ, "")


def test_ctrl_d_at_the_password_prompt_is_said_to_give_no_password() -> None:
    """At a terminal, Ctrl-D at the prompt ended in a traceback (EOFError)."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child, on the terminal as its controlling one
        try:
            os.execv(sys.executable, [sys.executable, "-m", "gpubroker", "password"])
        finally:
            os._exit(127)  # never on into the tests
    said = b""

    def read() -> bytes:
        if not select.select([terminal], [], [], 20)[0]:
            raise AssertionError(f"nothing more said in 20 s: {said!r}")
        return os.read(terminal, 1024)

    try:
        while b"UI password: " not in said:
            said += read()
        os.write(terminal, b"\x04")  # Ctrl-D
        with contextlib.suppress(OSError):  # EIO once the child has gone: all it said has been read
            while chunk := read():
                said += chunk
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # not left waiting at its prompt
        raise
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 2
    assert said.decode().replace("\r\n", "\n").endswith(NOTHING_READ), said


def test_with_a_password_it_serves_https_on_a_p256_certificate_and_the_cli_needs_the_token(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "gpubroker", "password"], input=PASSWORD + "\n", capture_output=True, text=True, check=True
    )
    config = tmp_path / "gpubroker.toml"
    config.write_text(made.stdout)
    port = free_port()
    broker = broker_process("1x24GiB", ["--config", str(config), "--listen", f"0.0.0.0:{port}"])
    broker.port = port
    broker.start()
    assert f"https://0.0.0.0:{port}" in broker.ready_line
    cert_path = broker.state / "ui" / "cert.pem"
    certificate = x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", port)).encode())
    assert certificate == x509.load_pem_x509_certificate(cert_path.read_bytes())
    public = certificate.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.curve.name == "secp256r1"
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert socket.gethostname().lower() in names.get_values_for_type(x509.DNSName)

    token = subprocess.run(
        [sys.executable, "-m", "gpubroker", "token", "--state", str(broker.state)], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {**broker.env, "GPUBROKER_URL": f"https://127.0.0.1:{port}", "GPUBROKER_CA": str(cert_path)}
    status = [sys.executable, "-m", "gpubroker", "status", "--json"]
    refused = subprocess.run(status, env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1
    assert "UNAUTHORIZED" in refused.stderr
    shown = subprocess.run(status, env={**env, "GPUBROKER_TOKEN": token}, capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(shown.stdout)["node"]["gpus"][0]["uuid"] == "GPU-sim-0"


# ----- what a review of the rules found --------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/\t/evil.example/",
        "/\n/evil.example/",
        "/\r/evil.example/",
        "//evil.example/",
        "/\\evil.example/",
        "https://evil.example/",
        "javascript:alert(1)",
    ],
)
async def test_signing_in_never_sends_the_browser_to_another_site(guarded: tuple[TestClient[Any, Any], Broker], target: str) -> None:
    client, _ = guarded
    form = await (await client.get("/login", params={"next": target})).text()
    assert 'name="next" value="/"' in form
    answer = await client.post("/login", data={"password": PASSWORD, "next": target}, allow_redirects=False)
    assert answer.status == 303
    assert answer.headers["Location"] == "/"


async def test_an_open_stream_ends_when_its_session_signs_out(
    guarded: tuple[TestClient[Any, Any], Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "POLL_EVERY", 0.05)
    client, broker = guarded
    csrf = await sign_in(client)
    answer = await client.get("/v1/stream")
    assert answer.status == 200
    await answer.content.readuntil(b"\n\n")  # connected
    assert (await client.post("/logout", data={"csrf": csrf}, allow_redirects=False)).status == 303
    broker.record_event("test.after_sign_out", "nobody signed out should see this")
    rest = await asyncio.wait_for(answer.content.read(), 5)  # the end of the stream, not a heartbeat's wait
    assert b"test.after_sign_out" not in rest
    answer.close()


async def test_a_change_from_the_same_host_under_another_scheme_is_refused(guarded: tuple[TestClient[Any, Any], Broker]) -> None:
    client, broker = guarded
    csrf = await sign_in(client)
    other = f"https://{client.server.host}:{client.server.port}"
    answer = await client.post("/v1/leases", json={"gpu_memory": "1GiB"}, headers={"X-CSRF-Token": csrf, "Origin": other})
    assert await error_of(answer) == (403, "FORBIDDEN")
    assert broker.list_leases(None, 10) == []


def test_a_hash_that_asks_scrypt_for_too_much_memory_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    greedy = hash_password(PASSWORD, n=FAST).replace(f"scrypt${FAST}$", f"scrypt${2**17}$", 1)
    with pytest.raises(PasswordError, match="MiB"):
        parse_hash(greedy)
    parse_hash(hash_password(PASSWORD))  # what `gpubroker password` makes is always usable


def test_the_api_token_is_one_however_many_make_it_at_once_and_only_its_owner_reads_it(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        tokens = set(pool.map(lambda _: load_or_create_api_token(tmp_path), range(32)))
    assert len(tokens) == 1
    path = api_token_path(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["api_token"]  # no half-made files left
    path.chmod(0o644)
    assert load_or_create_api_token(tmp_path) == tokens.pop()
    assert path.stat().st_mode & 0o777 == 0o600


class AgreeingClock:
    """A stand-in mesh whose members' clocks agree with this node's: their times are shown as they came."""

    def shift_of(self, node: str) -> float:
        return 0.0


async def test_ids_from_other_nodes_documents_are_quoted_in_the_urls_of_buttons(tmp_path: Path) -> None:
    client, broker = await serve(tmp_path, password=True)
    app = client.server.app
    assert app is not None
    hostile = "../cluster/nodes/n-victim"

    class Elsewhere(AgreeingClock):  # a mesh whose view holds another node's document with a hostile lease id
        def cluster_json(self) -> dict[str, Any]:
            lease = {"id": hostile, "holder": "x", "gpus": [[0, GIB]], "priority": "background", "granted_at": "not a time"}
            other = {"id": "n-other", "name": "other", "state": "alive", "self": False, "age": 1.0, "document": {"leases": [lease]}}
            return {"nodes": [{**cluster_view_alone(broker), "self": True}, other], "coordinator": None}

    app[MESH].mesh = Elsewhere()  # type: ignore[assignment]
    try:
        await sign_in(client)
        page = await (await client.get("/leases")).text()
        assert f'data-url="/v1/leases/{quote(hostile, safe="")}"' in page
        assert 'data-url="/v1/leases/../' not in page
        assert "not a time" in page  # shown as it came, not a server error
    finally:
        app[MESH].mesh = None
        await client.close()
        await broker.close()


async def test_records_of_another_nodes_document_this_reader_cannot_read_are_left_out_of_every_page(tmp_path: Path) -> None:
    client, broker = await serve(tmp_path, password=True)
    app = client.server.app
    assert app is not None
    good = {"id": "l-good", "holder": "kept", "gpus": [[0, GIB]], "priority": "background", "expires_at": "2026-11-30T10:00:00.000Z"}
    unreadable = [
        {**good, "id": "l-a", "gpus": [[0, "1GiB"]]},
        {**good, "id": "l-b", "gpus": [[0, None]]},
        {**good, "id": "l-c", "gpus": ["ab"]},
        {**good, "id": "l-d", "gpus": [[0, GIB, 3]]},  # a newer broker's shape, say
        {**good, "id": "l-e", "priority": 5},
        "not a record",
    ]

    class Elsewhere(AgreeingClock):
        def cluster_json(self) -> dict[str, Any]:
            document = {"name": "other", "gpus": [{"index": 0, "uuid": "GPU-o", "name": "x", "figures": {}}], "leases": [good, *unreadable]}
            other = {"id": "n-other", "name": "other", "state": "alive", "self": False, "age": 1.0, "document": document}
            return {"nodes": [{**cluster_view_alone(broker), "self": True}, other], "coordinator": None}

    app[MESH].mesh = Elsewhere()  # type: ignore[assignment]
    try:
        await sign_in(client)
        for path in ("/", "/leases", "/fragment/leases", "/fragment/cluster"):
            answer = await client.get(path)
            assert answer.status == 200, path
        page = await (await client.get("/leases")).text()
        assert "l-good" in page
        assert not any(f"l-{x}" in page for x in "abcde")
    finally:
        app[MESH].mesh = None
        await client.close()
        await broker.close()


def cluster_view_alone(broker: Broker) -> dict[str, Any]:
    return {"id": broker.node_id, "name": broker.config.name, "state": "alive", "age": 0.0, **broker.node_json()}


async def test_bodies_and_headers_that_cannot_be_read_get_the_one_error_shape_never_a_500(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    client, broker = guarded
    garbage = b"\x00not compressed at all" * 4
    for encoding in ("deflate", "gzip"):
        answer = await client.post("/v1/leases", data=garbage, headers={"Content-Encoding": encoding, "Authorization": f"Bearer {TOKEN}"})
        assert await error_of(answer) == (400, "INVALID_REQUEST"), encoding
    for origin in ("http://[", "http://[::1", "http://a:b:c"):
        answer = await client.post("/v1/leases", json={"cpu_cores": 1}, headers={"Origin": origin})
        assert await error_of(answer) == (403, "FORBIDDEN"), origin
    for content_type, body in [
        ("application/x-www-form-urlencoded; charset=bogus", b"password=a"),
        ("multipart/form-data", b"x"),
        ("multipart/form-data; boundary=zz", b"--zz\r\nbroken"),
        ("application/x-www-form-urlencoded; charset=utf-8", b"password=\xff\xfe"),
    ]:
        answer = await client.post("/login", data=body, headers={"Content-Type": content_type})
        assert await error_of(answer) == (400, "INVALID_REQUEST"), content_type
    csrf = await sign_in(client)
    assert csrf
    answer = await client.delete(
        "/v1/leases/l-000000000000", data=b"csrf=\xff\xfe", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert await error_of(answer) == (400, "INVALID_REQUEST")
    assert broker.list_leases(None, 10) == []


async def test_refused_sign_ins_are_events_and_a_flood_of_them_is_refused_at_once_not_queued(
    guarded: tuple[TestClient[Any, Any], Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker = guarded
    checked: list[str] = []
    go = threading.Event()

    def held_verify(password: str, password_hash: str) -> bool:
        checked.append(password)
        go.wait(10)  # every guess of the flood has arrived before any check ends
        return verify_password(password, password_hash)

    monkeypatch.setattr(pages, "verify_password", held_verify)
    flood = [asyncio.create_task(client.post("/login", data={"password": f"guess{i}"}, allow_redirects=False)) for i in range(30)]
    refused_at_once = 30 - SignIns.PER_ADDRESS
    for _ in range(500):
        if sum(task.done() for task in flood) >= refused_at_once:
            break
        await asyncio.sleep(0.01)
    assert [task.result().status for task in flood if task.done()] == [429] * refused_at_once  # none of them was queued
    go.set()
    statuses = sorted(answer.status for answer in await asyncio.gather(*flood))
    assert statuses == [401] * SignIns.PER_ADDRESS + [429] * refused_at_once
    assert len(checked) == SignIns.PER_ADDRESS
    assert all(task.result().headers.get("Retry-After") == "2" for task in flood if task.result().status == 429)
    right = await client.post("/login", data={"password": PASSWORD}, allow_redirects=False)
    assert right.status == 303
    await broker.store.commit([])  # the events handed over before now are on disk
    refused = [e for e in broker.events(0, 1000)[0] if e["type"] == "ui.sign_in.refused"]
    assert {e["details"]["reason"] for e in refused} == {"wrong password", "too many at once"}
    assert all(e["code"] == "UNAUTHORIZED" for e in refused)
    assert len(refused) + sum(e["details"].get("not_kept_before", 0) for e in refused) == 30


def test_guesses_from_one_address_do_not_keep_another_from_signing_in() -> None:
    sign_ins = SignIns()
    assert [sign_ins.admit("10.0.0.66") for _ in range(3)] == [True, True, False]
    assert sign_ins.admit("10.0.0.2")  # the admin, elsewhere, is checked next, not after the flood
    sign_ins.done("10.0.0.66")
    assert sign_ins.admit("10.0.0.66")
    for n in range(SignIns.PENDING):
        sign_ins.admit(f"10.1.{n // 256}.{n % 256}")
    assert not sign_ins.admit("10.0.0.3")  # and all addresses together are bounded too
    assert SignIns.source("2001:db8:1:2:aaaa::1") == SignIns.source("2001:db8:1:2:bbbb::7") == "2001:db8:1:2::/64"  # one host's /64
    assert SignIns.source("::ffff:10.0.0.9") == SignIns.source("10.0.0.9") == "10.0.0.9"
    assert SignIns.source(None) == "unknown"


async def test_an_expectation_is_met_only_after_the_callers_checks_and_an_unknown_one_gets_the_one_error_shape(
    guarded: tuple[TestClient[Any, Any], Broker],
) -> None:
    """aiohttp met `Expect` before any check: a caller without the token, or from a foreign Host, was told to send its
    body (up to max_body) only to be refused after, and an expectation it does not know was a 417 in plain text."""
    client, broker = guarded
    body = b'{"gpu_memory": "1GiB"}'

    def ask(headers: str, send_body_on: bytes = b"HTTP/1.1 100 Continue") -> bytes:
        with socket.create_connection((client.host, client.port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/leases HTTP/1.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                % (len(body), headers.encode())
            )
            first = sock.recv(65536)
            if not first.startswith(send_body_on):
                return first  # refused before its body was asked for
            sock.sendall(body)
            answer = first
            while more := sock.recv(65536):  # to the end: the connection closes after the answer
                answer += more
            return answer

    unsigned = await asyncio.to_thread(ask, "Host: 127.0.0.1\r\nExpect: 100-continue\r\n")
    assert unsigned.startswith(b"HTTP/1.1 401 ")
    assert b'"UNAUTHORIZED"' in unsigned
    foreign = await asyncio.to_thread(ask, f"Host: evil.example\r\nAuthorization: Bearer {TOKEN}\r\nExpect: 100-continue\r\n")
    assert foreign.startswith(b"HTTP/1.1 403 ")
    assert b'"FORBIDDEN"' in foreign
    unknown = await asyncio.to_thread(ask, f"Host: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nExpect: 200-ok\r\n")
    assert unknown.startswith(b"HTTP/1.1 417 ")
    error = json.loads(unknown.split(b"\r\n\r\n", 1)[1])["error"]
    assert (error["code"], error["details"]) == ("INVALID_REQUEST", {"expect": "200-ok"})
    assert broker.list_leases(None, 10) == []  # nothing was granted
    granted = await asyncio.to_thread(ask, f"Host: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nExpect: 100-continue\r\n")
    assert granted.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 ")
    assert len(broker.list_leases(None, 10)) == 1
