"""`pagedserve serve` with TLS: the frontend reads PAGEDSERVE_TLS_CERT/KEY, and the
launcher's health check follows it over TLS."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from e2e_util import serve
from models import make_tiny_model
from test_security import make_cert

from pagedserve.client import GenerationClient


def test_serve_over_tls(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    cert, key = make_cert(tmp_path)
    with serve("--model", model, "--num-gpu-blocks", "32",
               env={"PAGEDSERVE_TLS_CERT": cert, "PAGEDSERVE_TLS_KEY": key}) as server:
        with GenerationClient(server.addr, tls=cert) as c:
            ids, _, _ = c.generate("Hello", max_tokens=3, temperature=0.0)
            assert len(ids) >= 1
        with GenerationClient(server.addr) as plain, pytest.raises(grpc.RpcError):
            plain.generate("Hello", max_tokens=3, temperature=0.0, timeout=5)
