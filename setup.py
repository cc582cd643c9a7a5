"""Generates the gRPC stubs from proto/ at build (and editable install) time."""
from __future__ import annotations

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()


def generate_stubs() -> None:
    from grpc_tools import protoc  # build requirement, see pyproject.toml
    import grpc_tools

    proto_root = ROOT / "proto"
    out = ROOT
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))
    (out / "pagedserve" / "v1" / "__init__.py").write_text('"""Generated from proto/pagedserve/v1 at build time. Do not edit."""\n')


# Every build entry point (metadata, wheel, editable) runs this file, and the
# package list names pagedserve.v1, so the stubs must exist before setup().
generate_stubs()
setup()
