"""Private folders for ipc:// sockets.

An ipc socket is only as private as its folder: anyone who can write there
can bind a socket of the same name first, and anyone who can search it can
connect. So every folder that holds our sockets must belong to this user
and allow nobody else anything (0700); an existing folder that does not is
refused, never reused or fixed up.
"""
from __future__ import annotations

import os
import stat
import tempfile


class UnsafeRunDir(PermissionError):
    """An ipc socket folder that another user owns or may enter."""


def default_run_dir() -> str:
    """Where components started on their own put their sockets: a per-user
    folder (``$XDG_RUNTIME_DIR/pagedserve``, else ``$TMPDIR/pagedserve-UID``),
    checked by ``ensure_private_dir`` before use. ``pagedserve serve`` uses a
    fresh ``mkdtemp`` folder per run instead."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "pagedserve")
    return os.path.join(tempfile.gettempdir(), f"pagedserve-{os.geteuid()}")


def ensure_private_dir(path: str) -> None:
    """Creates ``path`` (0700) if missing; refuses it if it is a symlink, not
    a folder, owned by someone else, or open to group or others."""
    path = path or "."
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError as e:  # a file or dangling link of that name
        raise UnsafeRunDir(f"ipc socket folder {path} exists and is not a folder") from e
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunDir(f"ipc socket folder {path} is not a plain folder (a symlink?); refusing it")
    if st.st_uid != os.geteuid():
        raise UnsafeRunDir(f"ipc socket folder {path} belongs to uid {st.st_uid}, not to this user "
                           f"(uid {os.geteuid()}); refusing to use it: choose another with PAGEDSERVE_RUN_DIR")
    if st.st_mode & 0o077:
        raise UnsafeRunDir(f"ipc socket folder {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others "
                           f"may use it; refusing it (chmod 700 it, or choose another with PAGEDSERVE_RUN_DIR)")
