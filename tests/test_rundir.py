"""ipc socket folders: private (0700, ours) or refused with a clear error."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from pagedserve.common import ipc
from pagedserve.common.config import default_addresses
from pagedserve.common.messages import frontend as fe
from pagedserve.common.rundir import UnsafeRunDir, default_run_dir, ensure_private_dir


def foreign_dir(tmp_path: Path) -> Path:
    """A folder owned by another user: chown'ed when we are root, else one root owns."""
    if os.geteuid() == 0:
        d = tmp_path / "foreign"
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        return d
    return Path("/")


def test_missing_folder_is_created_private(tmp_path: Path) -> None:
    d = tmp_path / "a" / "run"
    ensure_private_dir(str(d))
    st = d.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    ensure_private_dir(str(d))  # reusing our own private folder is fine


def test_foreign_open_or_linked_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeRunDir, match="belongs to uid"):
        ensure_private_dir(str(foreign_dir(tmp_path)))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(UnsafeRunDir, match="mode 0770"):
        ensure_private_dir(str(shared))
    link = tmp_path / "link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link.symlink_to(private)
    with pytest.raises(UnsafeRunDir, match="not a plain folder"):
        ensure_private_dir(str(link))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeRunDir, match="not a folder"):
        ensure_private_dir(str(tmp_path / "file"))


def test_sockets_are_not_opened_in_a_foreign_folder(tmp_path: Path) -> None:
    d = foreign_dir(tmp_path)
    ctx: zmq.Context = zmq.Context()
    try:
        for bind in (True, False):
            with pytest.raises(UnsafeRunDir):
                ipc.PullQueue(ctx, f"ipc://{d}/scheduler_in.sock", fe.Request, bind=bind)
        assert not (d / "scheduler_in.sock").exists()
    finally:
        ctx.term()


def test_default_folder_is_per_user_not_shared(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDSERVE_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert default_run_dir() == str(tmp_path / f"pagedserve-{os.geteuid()}")
    assert default_addresses().worker == f"ipc://{tmp_path}/pagedserve-{os.geteuid()}/worker.sock"
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_run_dir() == str(runtime / "pagedserve")


def test_component_refuses_a_foreign_folder_with_a_clear_error(tmp_path: Path) -> None:
    d = foreign_dir(tmp_path)
    out = subprocess.run([sys.executable, "-m", "pagedserve", "blockmgr", "--blockmgr-addr",
                          f"ipc://{d}/blockmgr.sock"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pagedserve blockmgr: error: ipc socket folder" in out.stderr and "Traceback" not in out.stderr
