"""Starting the broker process: what `gpubroker up` refuses before it serves, and how it says so."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from gpubroker import daemon


def test_a_stale_socket_that_cannot_be_removed_is_a_start_error_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an OSError that `gpubroker up` would report as "the output could not be written"."""
    path = tmp_path / "api.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:  # a broker killed with -9 leaves its socket
        left.bind(str(path))

    def refused(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refused)  # another user's socket in a sticky directory
    with pytest.raises(daemon.StartError, match=f"cannot remove {path}, a socket no broker answers on: Operation not permitted"):
        daemon._free_socket(path)
