"""Which modules open sockets (issue 39), read from the source as
``test_boundaries.py`` reads imports: docs/architecture.md ("Who opens
sockets") names every module of the components and ``common`` that imports
``zmq`` or ``socket``, or makes a socket (a ``common/ipc.py`` socket class, a
context's ``socket()``, a ``get_monitor_socket()``), and names no other. The
pure cores (``Scheduler``, ``EngineCore``, ``BlockManager``, ``ModelRunner``)
stay off that list, so tests keep driving them in-process."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("frontend", "scheduler", "blockmgr", "gpuworker", "kernels", "common")
DOC = ROOT / "docs" / "architecture.md"
HEADING = "### Who opens sockets"
SOCKET_MODULES = {"zmq", "socket"}
SOCKET_METHODS = {"socket", "get_monitor_socket"}  # zmq.Context.socket, zmq.Socket.get_monitor_socket
# Modules that must never open one: the cores the tests drive in-process.
PURE = {"scheduler/core.py", "scheduler/requests.py", "scheduler/replies.py", "scheduler/results.py",
        "scheduler/preemption.py", "scheduler/intake.py", "blockmgr/manager.py", "gpuworker/model_runner.py"}


def ipc_socket_classes() -> set[str]:
    """The public classes of common/ipc.py: each one owns a socket it opens."""
    tree = ast.parse((ROOT / "common" / "ipc.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")}


def opens_sockets(source: str, classes: set[str]) -> list[str]:
    """Why a module's source counts as opening sockets (empty: it does not)."""
    why = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            why += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in SOCKET_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in SOCKET_MODULES:
            why.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in classes or (isinstance(f, ast.Attribute) and name in SOCKET_METHODS):
                why.append(f"{name}()")
    return why


def socket_owners() -> dict[str, list[str]]:
    classes = ipc_socket_classes()
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            why = opens_sockets(path.read_text(), classes)
            if why:
                out[path.relative_to(ROOT).as_posix()] = why
    return out


def documented_owners() -> set[str]:
    """The module paths in the first column of the docs' table."""
    text = DOC.read_text()
    assert HEADING in text, f"{DOC.name} lost its section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    return {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row.split("|")[1])}


def test_the_check_sees_each_way_of_opening_a_socket() -> None:
    classes = ipc_socket_classes()
    assert {"ReqClient", "RepServer", "PushQueue", "PullQueue", "AsyncPushQueue", "AsyncPullQueue"} <= classes
    cases = {
        "import zmq": True,
        "import zmq.asyncio": True,
        "from zmq.utils.monitor import recv_monitor_message": True,
        "import socket": True,
        "from socket import create_connection": True,
        "from pagedserve.common import ipc\nq = ipc.PushQueue(ctx, addr, bind=True)": True,
        "from pagedserve.common.ipc import ReqClient\nc = ReqClient(ctx, addr, T)": True,
        "s = ctx.socket(5)": True,
        "m = q.sock.get_monitor_socket(1)": True,
        # Handed a socket, or naming its class in a hint: that module does not open one.
        "from pagedserve.common import ipc\ndef f(q: ipc.PullQueue) -> None:\n    q.get_nowait()": False,
        "from pagedserve.common.messages import frontend as fe\nx = fe.Outputs([])": False,
        "import socketserver": False,
    }
    for source, expected in cases.items():
        assert bool(opens_sockets(source, classes)) is expected, source


def test_the_docs_name_exactly_the_modules_that_open_sockets() -> None:
    found = socket_owners()
    documented = documented_owners()
    assert "scheduler/service.py" in found and "scheduler/service.py" in documented  # the real tree was read
    missing = {m: found[m] for m in sorted(set(found) - documented)}
    stale = sorted(documented - set(found))
    assert not missing and not stale, (
        f"docs/architecture.md ({HEADING!r}) does not match the source.\n"
        f"  opens sockets, not in the table: {missing}\n  in the table, opens none: {stale}")


def test_the_pure_cores_open_no_socket() -> None:
    found = socket_owners()
    assert all((ROOT / m).exists() for m in PURE), "a pure core moved: update PURE"
    assert not PURE & set(found), {m: found[m] for m in PURE & set(found)}
