"""Component boundaries (issue 21, acceptance 1 and 2), read from the source:
each component's folder stands alone (it imports only itself and ``common``;
the gpuworker also the kernels; none imports the CLI layer), there is no
circular import, and no non-test module is over 400 lines. And the frontend's
modules and app objects load without torch (the worker's), checked in a fresh
interpreter."""
from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve.common.graph import strongly_connected

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("frontend", "scheduler", "blockmgr", "gpuworker", "kernels", "common")  # pagedserve.<name>
# What each folder may import from pagedserve.*. The kernels are a library the
# worker configures (cpu_build.configure), so they import nothing of ours;
# pagedserve.v1 is the frontend's generated gRPC API. Anything else (another
# component, pagedserve.cli/serve_args/launcher/client/bench/...) is a violation.
ALLOWED: dict[str, set[str]] = {
    "frontend": {"frontend", "common", "v1"},
    "scheduler": {"scheduler", "common"},
    "blockmgr": {"blockmgr", "common"},
    "gpuworker": {"gpuworker", "common", "kernels"},
    "kernels": {"kernels"},
    "common": {"common"},
}
MAX_LINES = 400


@dataclass(frozen=True)
class Import:
    source: str  # importing module, pagedserve.<...>
    target: str  # imported module (or package), pagedserve.<...>
    line: int
    late: bool  # inside a function or an ``if TYPE_CHECKING:`` block: not run at import time


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pagedserve", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(body: list[ast.stmt], late: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it runs only later (function level or TYPE_CHECKING)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, late
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(node.body, True)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, True)
            yield from _walk(node.orelse, late)
        else:  # class bodies, if/try/with/for blocks: run when their parent runs
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, []) or []:
                    if isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from _walk(child.body, late)
                    elif isinstance(child, ast.stmt):
                        yield from _walk([child], late)


def _imports_of(mod: str, is_package: bool, source: str, modules: set[str] | dict[str, Path]) -> list[Import]:
    """The pagedserve imports of one module's source (``modules``: the names that are modules)."""
    package = mod if is_package else mod.rpartition(".")[0]
    out = []
    for node, late in _walk(ast.parse(source).body, False):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # "from pkg import name": the submodule pkg.name when there is one, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules or base == "pagedserve" else base
                     for a in node.names]
        out += [Import(mod, n, node.lineno, late) for n in dict.fromkeys(names)
                if n == "pagedserve" or n.startswith("pagedserve.")]
    return out


def _imports(modules: dict[str, Path]) -> list[Import]:
    return [i for mod, path in modules.items()
            for i in _imports_of(mod, path.name == "__init__.py", path.read_text(), modules)]


MODULES = _modules()
IMPORTS = _imports(MODULES)


def test_the_walk_sees_every_kind_of_import() -> None:
    source = """
from typing import TYPE_CHECKING
import pagedserve.common.env
from . import b
from ..common import config
if TYPE_CHECKING:
    from pagedserve.frontend.c import X
else:
    import pagedserve.frontend.d
try:
    from pagedserve.frontend import e
except ImportError:
    pass
class K:
    import pagedserve.frontend.f
    def m(self):
        from pagedserve.gpuworker import g
"""
    modules = {"pagedserve.frontend." + n for n in "abcdef"} | {"pagedserve.common.config"}
    got = {(i.target, i.late) for i in _imports_of("pagedserve.frontend.a", False, source, modules)}
    assert got == {("pagedserve.common.env", False), ("pagedserve.frontend.b", False),
                   ("pagedserve.common.config", False), ("pagedserve.frontend.c", True),
                   ("pagedserve.frontend.d", False), ("pagedserve.frontend.e", False),
                   ("pagedserve.frontend.f", False), ("pagedserve.gpuworker", True)}
    assert "pagedserve.scheduler.core" in MODULES and len(IMPORTS) > 200  # the real tree was read


def test_no_component_imports_another_or_the_cli_layer() -> None:
    bad = []
    for i in IMPORTS:
        owner = i.source.split(".")[1]
        part = i.target.split(".")[1] if "." in i.target else "(pagedserve itself)"
        if part not in ALLOWED[owner]:
            bad.append(f"{MODULES[i.source].relative_to(ROOT)}:{i.line} imports {i.target}")
    assert not bad, "imports across component boundaries:\n" + "\n".join(bad)


def test_frontend_core_imports_no_protocol_layer() -> None:
    """The frontend's core serves both APIs: it never imports the OpenAI layer, and of the gRPC
    layer only its request decoding (the core's request type is gRPC's message)."""
    allowed = {"pagedserve.frontend.grpc_api.grpc_decode"}
    bad = [f"{MODULES[i.source].relative_to(ROOT)}:{i.line} imports {i.target}" for i in IMPORTS
           if i.source.startswith("pagedserve.frontend.core")
           and i.target.startswith(("pagedserve.frontend.openai_api", "pagedserve.frontend.grpc_api"))
           and i.target not in allowed]
    assert not bad, "the frontend's core imports a protocol layer:\n" + "\n".join(bad)
    assert any(i.source.startswith("pagedserve.frontend.openai_api") and i.target.startswith(
        "pagedserve.frontend.core") for i in IMPORTS), "the walk sees no import of the core at all"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    return sorted(sorted(c) for c in strongly_connected(edges) if len(c) > 1)


def _edges(include_late: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in MODULES and i.target != i.source and (include_late or not i.late):
            edges[i.source].add(i.target)
    return edges


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_circular_import() -> None:
    """Module-level imports only (what runs at import time; TYPE_CHECKING blocks left out)."""
    cycles = _cycles(_edges(include_late=False))
    assert not cycles, "circular imports:\n" + "\n".join(" <-> ".join(c) for c in cycles)


# Late loops still there, each as its sorted modules: frontend/core/structured.py imports
# validation.ValidationError, while validation.sampling_params imports structured inside the
# function. Breaking it takes ValidationError into a module both import (structured.py's change).
KNOWN_LATE_CYCLES: set[tuple[str, ...]] = {("pagedserve.frontend.core.structured", "pagedserve.frontend.core.validation")}


def test_no_circular_import_even_through_late_imports() -> None:
    """Counting function-level and TYPE_CHECKING imports too, so the loops issue 21 named
    (scheduler core/preemption/results, the HTTP gateway and its route modules) stay broken."""
    cycles = [c for c in _cycles(_edges(include_late=True)) if tuple(c) not in KNOWN_LATE_CYCLES]
    assert not cycles, "circular imports through late imports:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _source_files() -> Iterator[Path]:
    skip = {"tests", "node_modules", "__pycache__", "build", "dist"}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))  # tests, the venv, caches
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py") and "_pb2" not in f)  # not generated


def test_no_module_over_400_lines() -> None:
    files = list(_source_files())
    assert any(p.name == "core.py" for p in files) and any(p.parts[-2:] == ("pagedserve", "cli.py") for p in files)
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


# ---------------------------------------------------------------- the frontend process
def _heavy_modules(child: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> list[str]:
    """Runs ``child`` (which prints "HEAVY m1,m2,...") in a fresh interpreter; the modules it reports."""
    r = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, timeout=180,
                       env=env, cwd=cwd)  # cwd: not tests/, so only the installed package is importable
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("HEAVY", "NOT SERVING"))]
    assert lines and lines[-1].startswith("HEAVY"), f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return [m for m in lines[-1].removeprefix("HEAVY").strip().split(",") if m]


_FRONTEND_MODULES_CHILD = r"""
import pkgutil, sys

import pagedserve.frontend
from pagedserve.frontend import service
for m in pkgutil.walk_packages(pagedserve.frontend.__path__, "pagedserve.frontend."):
    __import__(m.name)
from pagedserve.common.config import default_addresses
from pagedserve.common.metrics import FrontendMetrics
from pagedserve.frontend.openai_api import http_gateway, openai_structured
from pagedserve.frontend.core.auth import ApiKeys
from pagedserve.frontend.core.engine_client import EngineClient
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
from pagedserve.frontend.grpc_api.server import GenerationServicer
from pagedserve.v1 import generation_pb2 as pb

# The app objects start-up builds (no tokenizer: loading one is transformers', see below).
engine = EngineClient(default_addresses(sys.argv[1]))
metrics = FrontendMetrics(lambda: engine.last_stats, lambda: engine.num_streams)
svc = GenerationService(engine, None, FrontendConfig(), metrics)
GenerationServicer(svc, ApiKeys([]))
http_gateway.Gateway(svc, ApiKeys([]), metrics.registry, lambda: True).app()
if sys.argv[2] == "structured":  # a structured-output body through the HTTP gateway's validation
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
    openai_structured.apply_structured(body, pb.SamplingParams())
print("HEAVY " + ",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))), flush=True)
"""


def test_the_frontend_package_does_not_import_torch(tmp_path: Path) -> None:
    """Every frontend module and the app objects its start-up builds, in a fresh interpreter:
    torch and triton (the worker's) stay out."""
    heavy = _heavy_modules(_FRONTEND_MODULES_CHILD, str(tmp_path / "run"), "start-up", cwd=tmp_path)
    assert not heavy, f"the frontend's modules imported {heavy[:10]}"


def test_validating_a_structured_output_spec_does_not_import_torch(tmp_path: Path) -> None:
    """xgrammar's parse runs in the frontend's grammar-check child (frontend/core/grammar_check.py)."""
    heavy = _heavy_modules(_FRONTEND_MODULES_CHILD, str(tmp_path / "run"), "structured", cwd=tmp_path)
    assert not heavy, f"validating a JSON schema in the frontend imported {heavy[:10]}"


_FRONTEND_PROCESS_CHILD = r"""
import os, socket, sys, threading, time

model, grpc_port, http_port = sys.argv[1], sys.argv[2], int(sys.argv[3])


def report_once_serving() -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                print("NOT SERVING", flush=True)
                os._exit(3)
            time.sleep(0.1)
    print("HEAVY " + ",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))), flush=True)
    os._exit(0)


threading.Thread(target=report_once_serving, daemon=True).start()
from pagedserve.frontend import service

service.main(["--model", model, "--port", grpc_port, "--http-port", str(http_port), "--engine-timeout", "300"])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_frontend_process_starts_without_torch(tmp_path: Path) -> None:
    """The real start-up, as `pagedserve frontend` (tokenizer loaded, gRPC and HTTP listening,
    waiting for the scheduler): no torch or triton in sys.modules."""
    from models import train_tokenizer

    model = tmp_path / "tok"
    train_tokenizer(200).save_pretrained(model)  # the frontend reads only the tokenizer
    env = {**os.environ, "PAGEDSERVE_RUN_DIR": str(tmp_path / "run")}
    heavy = _heavy_modules(_FRONTEND_PROCESS_CHILD, str(model), str(_free_port()), str(_free_port()),
                           cwd=tmp_path, env=env)
    assert not heavy, f"the frontend process imported {heavy[:10]}"


# ---------------------------------------------------------------- the wheel and benchmarks/
def _wheel_package_dirs() -> dict[str, Path]:
    """Every package the wheel ships, as pyproject.toml maps it to a folder."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool.get("package-dir", {})
    out = {}
    for pkg in tool["packages"]:
        parent = pkg  # a package not named in package-dir sits under its parent's folder
        while parent not in dirs and "." in parent:
            parent = parent.rpartition(".")[0]
        base = ROOT / dirs.get(parent, parent.replace(".", "/"))
        out[pkg] = base.joinpath(*pkg[len(parent):].strip(".").split(".")) if pkg != parent else base
    return out


def _imports_benchmarks(source: str) -> list[int]:
    """Lines that import the top-level ``benchmarks`` package (at any depth, late ones too)."""
    lines = []
    for node, _late in _walk(ast.parse(source).body, False):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            ([node.module or ""] if node.level == 0 else [])
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_engine_does_not_import_benchmarks() -> None:
    """benchmarks/ (peer harnesses, vLLM diffs, guidellm, experiments) imports the engine, never
    the other way: it is not in the wheel (tests/test_wheel.py)."""
    assert _imports_benchmarks("import benchmarks.peers\ndef f():\n    from benchmarks import serving\n") == [1, 3]
    assert _imports_benchmarks("from . import benchmarks\nimport benchmarksx\n") == []
    dirs = _wheel_package_dirs()
    assert "benchmarks" not in dirs and not any(p.startswith("benchmarks") for p in dirs)
    assert {"pagedserve", "pagedserve.bench", "pagedserve.frontend", "pagedserve.common"} <= set(dirs)
    bad, seen = [], 0
    for pkg, folder in dirs.items():
        for path in sorted(folder.glob("*.py")):  # this package's own modules; subpackages are listed too
            seen += 1
            bad += [f"{path.relative_to(ROOT)}:{n}" for n in _imports_benchmarks(path.read_text())]
    assert seen > 100, seen
    assert not bad, "the engine imports benchmarks/:\n" + "\n".join(bad)
