"""Configuration: every setting documented, files and flags read, mistakes named."""

from __future__ import annotations

import os
import re
import time
import tomllib
from pathlib import Path
from socket import gethostname

import pytest

from gpubroker import cli
from gpubroker.config import SETTINGS, Config, ConfigError, Setting, Stamp, default_socket, load_config
from gpubroker.gossip.cluster import ClusterState, decode_token
from gpubroker.gossip.identity import Identity

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("setting", [s.name for s in SETTINGS])
def test_every_setting_is_documented_in_the_readme(setting: str) -> None:
    assert f"| `{setting}` |" in README.read_text(), f"README's settings table misses {setting}"


def test_every_setting_has_a_default_and_help() -> None:
    defaults = Config()
    for setting in SETTINGS:
        assert setting.help
        assert hasattr(defaults, setting.name)


def test_a_file_and_flags_make_one_config_with_flags_winning(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text('reserve = "2GiB"\nstaleness = "2s"\nlisten = "127.0.0.1:9999"\n[[stamp]]\nuser = "shadow"\npriority = "background"\n')
    config = load_config(path, listen="127.0.0.1:9000")
    assert config.reserve == 2 * 2**30
    assert config.staleness == 2.0
    assert config.listen == "127.0.0.1:9000"
    assert config.stamps == (Stamp("background", user="shadow"),)
    assert config.stamped_class("production", "shadow", None) == "background"
    assert config.stamped_class("production", "alice", None) == "production"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('reserve = "lots"', "setting reserve"),
        ('listen = "nowhere"', "setting listen"),
        ("colour = 1", "unknown setting 'colour'"),
        ("queue_limit = 0", "setting queue_limit"),
        ('sample_interval = "0s"', "setting sample_interval: '0s' is under the least it may be, 0.1s"),
        ('staleness = "0s"', "setting staleness"),
        ('staleness = "1s"', r"^\S*gpubroker\.toml: staleness \(1s\) must be longer than sample_interval \(1s\)"),
        ('default_ttl = "0s"', "setting default_ttl: '0s' is under the least it may be, 1s"),
        ("max_body = 0", "setting max_body: 0 is under the least it may be, 1KiB"),
        ('store_size = "1KiB"', "setting store_size: '1KiB' is under the least it may be, 1MiB"),
        ('[[stamp]]\npriority = "urgent"\nuser = "x"', "priority must be one of"),
        ('[[stamp]]\npriority = "background"\nuser = 1000', r"\[\[stamp\]\] .*: user must be a Unix user's name, quoted and not empty"),
        ('[[stamp]]\npriority = "background"\nuser = ""', "user must be a Unix user's name, quoted and not empty"),
        ('[[stamp]]\npriority = "background"\nholder = ["tdarr*"]', "holder must be a holder name pattern, quoted and not empty"),
        ('[[stamp]]\npriority = "background"\nholder = " "', "holder must be a holder name pattern, quoted and not empty"),
        ('advertise = "192.168.1.20:9741"', "setting advertise: '192.168.1.20:9741' is not a host name or address: give it with no port"),
        ('advertise = "[fe80::1]"', "setting advertise: .* is not a host name or address"),
        ('advertise = "tower lan"', "setting advertise: 'tower lan' is not a host name or address"),
        (
            "staleness = 2.5",
            r"setting staleness: duration 2\.5 is a number with a decimal point: give seconds as an integer, or a string with a unit "
            r"\(2\.5s, 500ms\)",
        ),
        ("staleness = 2.0", r"duration 2\.0 is a number with a decimal point: give seconds as an integer"),  # whole, but not an integer
        ("staleness = 1234567.5", r"a string with a unit \(1234567\.5s, 500ms\)"),  # as it is written, not 1.23457e+06s
        ("staleness = 0.00001", r"a string with a unit \(0\.00001s, 500ms\)"),
        ("staleness = 1e-300", r"a string with a unit \(30s, 500ms\)"),
        (
            "reserve = 1.5",
            r"setting reserve: size 1\.5 is a number with a decimal point: give bytes as an integer, or a string with a unit \(1\.5GiB",
        ),
        ("not toml ===", "gpubroker.toml"),
        ('name = ""', "setting name: '' is not a node name"),
        ('name = "   "', "setting name: '   ' is not a node name"),
        ('name = "tower\\u001b[2J"', "is not a node name: 1 to 64 printable characters"),
        (f'name = "{"n" * 65}"', "is not a node name"),
        ('state_dir = ["/srv/gpubroker"]', r"setting state_dir: \['/srv/gpubroker'\] is not a string of text"),
        ('state_dir = ""', "setting state_dir: '' is not a string of text"),
        ("socket = true", "setting socket: True is not a string of text"),
        ("simulate_gpus = 2", "setting simulate_gpus: 2 is not a string of text"),
        ("advertise = 10", "setting advertise: 10 is not a string of text"),
        ("name = 7", "setting name: 7 is not a node name"),
        ('allowed_hosts = ["tower.lan:9740"]', "setting allowed_hosts: 'tower.lan:9740' is not a host name or address"),
        ('allowed_hosts = ["[fe80::1]"]', r"setting allowed_hosts: '\[fe80::1\]' is not a host name or address"),
        ('allowed_hosts = [""]', "setting allowed_hosts: '' is not a host name or address"),
    ],
)
def test_a_mistake_in_the_file_is_named(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('reseve = "2GiB"', "unknown setting 'reseve' (did you mean reserve?); the settings are: state_dir, "),
        ('Reserve = "2GiB"', "unknown setting 'Reserve' (did you mean reserve?)"),
        ("leases_keep = 50", "unknown setting 'leases_keep' (did you mean leases_kept?)"),
        ('[[stamps]]\nuser = "shadow"\npriority = "background"', "unknown setting 'stamps' (did you mean stamp?)"),
        ('[[stamp]]\nusr = "shadow"\npriority = "background"', "unknown key 'usr' (did you mean user?); only priority, user and holder"),
    ],
)
def test_a_misspelt_setting_is_refused_naming_the_nearest_one(tmp_path: Path, text: str, named: str) -> None:
    """A user reading `unknown setting 'reseve'` followed by 24 names had to find the one meant."""
    path = tmp_path / "gpubroker.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert named in str(refused.value)
    assert str(refused.value).startswith(f"{path}: ")


def test_a_mistake_in_the_file_names_the_file_and_one_in_a_flag_does_not(tmp_path: Path) -> None:
    """A setting may be given in the file or as a flag (`--simulate-gpus`, `--listen`): the message says which to fix."""
    path = tmp_path / "gpubroker.toml"
    path.write_text('reserve = "-5GiB"\n')
    with pytest.raises(ConfigError) as in_file:
        load_config(path)
    assert str(in_file.value) == f"{path}: setting reserve: size '-5GiB' is not bytes or a number with a unit (8GiB, 512MiB, 8GB)"
    path.write_text('reserve = "2GiB"\n')
    with pytest.raises(ConfigError) as in_flag:
        load_config(path, listen="nowhere")
    assert str(in_flag.value) == "setting listen: 'nowhere' is not HOST:PORT"


@pytest.mark.parametrize(
    ("given", "kept"),
    [(":::9740", "[::]:9740"), ("::1:9740", "[::1]:9740"), ("fe80::1%eth0:9740", "[fe80::1%eth0]:9740"), ("[::1]:0", "[::1]:0")],
)
def test_an_ipv6_listen_address_given_bare_is_kept_in_brackets(given: str, kept: str) -> None:
    assert load_config(None, listen=given).listen == kept


@pytest.mark.parametrize("given", ["::1", "fe80::1"])
def test_an_ipv6_address_without_a_port_is_refused_not_read_as_another_address(given: str) -> None:
    """`--listen ::1` (the loopback, no port) was read as host `:` port 1, and refused as `[:]:1` beyond the loopback."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, listen=given)
    assert str(refused.value) == f"setting listen: {given!r} is not HOST:PORT (an IPv6 address goes in brackets, with its port: [::1]:9740)"


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("127.0.0.1:\uff12\uff14\uff10\uff11\uff11", ""),  # fullwidth digits: bound, then printed as a URL no client reads
        ("127.0.0.1:\u00b2", ""),  # a superscript two: int() refused it in a Python message
        ("[::1:24005", " (an IPv6 address goes in brackets, with its port: [::1]:9740)"),  # printed as http://[::1:24005
        ("[127.0.0.1]:9740", " (an IPv6 address goes in brackets, with its port: [::1]:9740)"),
    ],
)
def test_a_listen_address_with_a_port_in_other_digits_or_brackets_left_open_is_refused(given: str, hint: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, listen=given)
    assert str(refused.value) == f"setting listen: {given!r} is not HOST:PORT{hint}"


def test_allowed_hosts_are_names_and_addresses_as_a_host_header_names_them(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text('allowed_hosts = ["tower.lan", "gpu-box_2", "10.0.0.5", "fe80::1"]\n')
    assert load_config(path).allowed_hosts == ("tower.lan", "gpu-box_2", "10.0.0.5", "fe80::1")


@pytest.mark.parametrize("given", ["192.168.1.20", "tower.lan", "fe80::1"])
def test_advertise_takes_a_host_name_or_address(given: str) -> None:
    assert load_config(None, advertise=given).advertise == given


def test_advertise_given_with_a_port_as_a_flag_is_refused() -> None:
    """`--advertise 192.168.1.20:9741` started a node its peers called at that text, port 9741, never reaching it."""
    with pytest.raises(ConfigError, match=r"^setting advertise: '192\.168\.1\.20:9741' is not a host name or address"):
        load_config(None, advertise="192.168.1.20:9741")


def test_a_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_bytes(b'\xef\xbb\xbfreserve = "2GiB"\n')  # as Notepad saves UTF-8
    assert load_config(path).reserve == 2 * 2**30


def test_a_file_not_in_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_bytes(b'reserve = "2GiB"\n# r\xe9serve for the desktop\n')
    with pytest.raises(ConfigError, match=r"gpubroker.toml: not UTF-8, as a TOML file must be: byte 0xe9 at line 2"):
        load_config(path)


def test_a_node_goes_on_with_the_name_it_was_admitted_with_unless_one_is_given(tmp_path: Path) -> None:
    """`gpubroker init --name h6node`, then a plain `gpubroker up`: the node ran under the hostname, and `nodes list`
    showed it as the hostname, admitted as h6node. So with a name given to `up --join` or `--ask`, at the next start."""
    first, joined = tmp_path / "first", tmp_path / "joined"
    founder = Identity.load_or_create(first)
    cluster = ClusterState.init(first, founder, "h6node")
    token = decode_token(cluster.invite(("127.0.0.1", 9), founder, 600, time.time()))
    newcomer = Identity.load_or_create(joined)
    grant = cluster.redeem(token.secret, newcomer.certificate_pem().decode(), "h7node", time.time(), founder.node_id)
    ClusterState.adopt(joined, newcomer, "h7node", grant, token=token)
    assert load_config(None, state_dir=str(first)).name == "h6node"
    assert load_config(None, state_dir=str(joined)).name == "h7node"

    assert load_config(None, state_dir=str(first), name="renamed").name == "renamed"  # `up --name`
    path = tmp_path / "gpubroker.toml"
    path.write_text(f'state_dir = "{first}"\nname = "from-file"\n')
    assert load_config(path).name == "from-file"
    (first / "cluster.json").write_text("{")  # damaged: the broker says so when it starts
    assert load_config(None, state_dir=str(first)).name == gethostname()


def _readme_settings() -> dict[str, str]:
    """The README's settings table: each setting's name and its default as written there."""
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| .+ \|$", README.read_text().partition("## Settings")[2], re.MULTILINE)
    return dict(rows)


def test_the_readme_documents_the_settings_read_and_no_other() -> None:
    """A setting renamed or dropped in the code must not stay documented (a homelab user's file would be refused)."""
    assert list(_readme_settings()) == [s.name for s in SETTINGS]


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_each_default_in_the_readme_is_the_one_used(setting: Setting) -> None:
    """A default given in backticks is a value the file could hold, read as the file's would be; a default that is
    worked out at start (the hostname, a path) is described instead."""
    written = _readme_settings()[setting.name]
    if setting.default is None:
        assert not re.fullmatch(r"`[^`]+`", written), f"{setting.name} has no fixed default, but the README gives {written}"
        return
    assert re.fullmatch(r"`[^`]+`", written), f"{setting.name}'s default ({setting.default!r}) is not written as a value: {written}"
    try:
        value = tomllib.loads(f"value = {written.strip('`')}")["value"]
    except tomllib.TOMLDecodeError:  # 5s, 1GiB, 127.0.0.1:9740: written bare, quoted in a file
        value = written.strip("`")
    assert setting.parse(value) == setting.default
    assert getattr(Config(), setting.name) == setting.default


@pytest.mark.parametrize("command", [["up", "--listen", "127.0.0.1:99999"], ["init"], ["token"]])
def test_an_empty_config_name_is_refused_not_taken_for_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """`--config "$CONF"` with CONF unset ran on every default (the state directory, the listen address) without a word."""
    assert cli.main([*command, "--config", "", "--state", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "gpubroker: --config names no file (it was given an empty name): give the TOML file, or leave --config out\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_roots_default_socket_is_the_systems_whatever_its_runtime_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root logged in (ssh, `sudo -i`) has XDG_RUNTIME_DIR=/run/user/0: a broker it started put its socket there, which
    no other user may enter, so every other user's client missed it and fell back to TCP, where no holder is bound."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_socket() == Path("/run/gpubroker/api.sock")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket() == Path("/run/user/1000/gpubroker/api.sock")  # a user's own broker: that user's
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", "/home/ann/.local/state")
    assert default_socket() == Path("/home/ann/.local/state/gpubroker/api.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")  # relative: a broker made ./run/gpubroker/api.sock, found from there alone
    assert default_socket() == Path("/home/ann/.local/state/gpubroker/api.sock")
