"""The broker as users start it: the installed command and the built binary, API, pages and HTTPS."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import BINARY, BrokerProcess, free_port


def test_a_broker_process_reports_its_simulated_gpu(broker_process: type[BrokerProcess]) -> None:
    broker = broker_process("1x24GiB").start()
    node = broker.client().call("GET", "/v1/node")
    assert [g["uuid"] for g in node["gpus"]] == ["GPU-sim-0"]
    assert node["gpus"][0]["figures"]["total"] == 24 * 2**30


def test_the_web_ui_is_served_with_its_assets_and_on_a_lan_address_over_https(
    gpubroker: list[str], broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """Pages, stylesheet and script come from the package (or the binary's bundle); a LAN address takes a
    password, then serves HTTPS on the node's own P-256 certificate (the binary bundles what that needs)."""
    broker = broker_process("1x24GiB", command=gpubroker).start()
    for path, kind, marker in (
        ("/", "text/html", "GPU-sim-0"),
        ("/static/live.js", "javascript", "EventSource"),
        ("/static/style.css", "css", "--schedulable"),
    ):
        with urllib.request.urlopen(broker.url + path, timeout=10) as answer:
            assert kind in answer.headers["Content-Type"], path
            assert marker in answer.read().decode(), path
    broker.stop()

    refused = subprocess.run(
        [
            *gpubroker,
            "up",
            "--state",
            str(tmp_path / "lan"),
            "--socket",
            str(tmp_path / "lan.sock"),
            "--listen",
            f"0.0.0.0:{free_port()}",
            "--simulate-gpus",
            "1x24GiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "ui_password_hash" in refused.stderr
    made = subprocess.run(
        [*gpubroker, "password"], input="a long enough password\n", capture_output=True, text=True, timeout=60, check=True
    )
    config = tmp_path / "lan.toml"
    config.write_text(made.stdout)
    port = free_port()
    lan = broker_process("1x24GiB", ["--config", str(config), "--listen", f"0.0.0.0:{port}"], command=gpubroker)
    lan.port = port
    lan.start()
    context = ssl.create_default_context(cafile=str(lan.state / "ui" / "cert.pem"))
    with pytest.raises(urllib.error.HTTPError) as unauthenticated:
        urllib.request.urlopen(f"https://127.0.0.1:{port}/", context=context, timeout=10)
    assert unauthenticated.value.code == 401
    assert 'action="/login"' in unauthenticated.value.read().decode()


@pytest.mark.slow
def test_the_binary_starts_without_setuptools() -> None:
    """Nothing gpubroker runs needs setuptools or pkg_resources, yet once bundled (pulled in through lmdb's cffi
    fallback) their runtime hooks imported them at every start: `gpubroker --version` took 0.4 s, twice the installed
    command's. The bundle is read as the binary's loader reads it: its start scripts, and the modules it holds."""
    from PyInstaller.archive.readers import CArchiveReader

    if not BINARY.exists():
        pytest.fail(f"{BINARY} is missing: run packaging/build first")
    bundle = CArchiveReader(str(BINARY))
    scripts = [name for name, entry in bundle.toc.items() if entry[-1] == "s"]
    assert scripts[-1] == "entry"
    assert not [name for name in scripts if "setuptools" in name or "pkgres" in name], scripts
    modules = {name.split(".")[0] for name in bundle.open_embedded_archive("PYZ.pyz").toc}
    assert {"gpubroker", "lmdb", "cryptography"} <= modules
    assert not modules & {"setuptools", "pkg_resources", "distutils", "cffi"}


@pytest.mark.parametrize(
    ("how", "config"),
    [
        (["--simulate-gpus=1x12GiB"], ""),
        ([], 'simulate_gpus = "1x12GiB"\n'),  # flags override the file: a default given as a flag would win
    ],
    ids=["flag-with-equals", "config-file"],
)
def test_dev_up_runs_the_gpus_its_flags_or_config_simulate(how: list[str], config: str, tmp_path: Path) -> None:
    """`./dev up` adds simulated 2x24GiB GPUs where there is no driver only when it is not told which to simulate."""
    repo = Path(__file__).resolve().parent.parent
    if Path(sys.executable).resolve() != (repo / ".venv" / "bin" / "python").resolve():
        pytest.skip("./dev runs the repository's .venv, which is not the interpreter of these tests")
    (tmp_path / "gpubroker.toml").write_text(
        config + f'state_dir = "{tmp_path / "state"}"\nsocket = "{tmp_path / "api.sock"}"\nlisten = "127.0.0.1:{free_port()}"\n'
    )
    up = subprocess.Popen(
        [str(repo / "dev"), "up", "--config", str(tmp_path / "gpubroker.toml"), *how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:  # setting up .venv, the line that says what dev adds, then the broker's
            said.append(line)
            if line.startswith("gpubroker ready"):
                break
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=30)
    assert "1 GPU via simulated (1x12GiB)" in said[-1], "".join(said)
    assert not any("running on simulated GPUs (2x24GiB)" in line for line in said)
