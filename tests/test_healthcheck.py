"""`pagedserve healthcheck`, the containers' readiness check (issue 13), without containers."""
from __future__ import annotations

import http.server
import socket
import threading

from pagedserve import healthcheck


def test_tcp_ipc_and_http_checks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert healthcheck.main(["tcp", str(port)]) == 0
        assert healthcheck.check_role(["blockmgr", "--blockmgr-addr", f"tcp://0.0.0.0:{port}"])
    assert healthcheck.main(["tcp", str(port)]) == 1  # closed
    sock = tmp_path / "worker.sock"
    assert healthcheck.main(["ipc", str(sock)]) == 1
    sock.touch()
    assert healthcheck.check_role(["gpuworker", "--worker-addr", f"ipc://{sock}"])

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 503)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        mport = srv.server_address[1]
        assert healthcheck.check_role(["scheduler", "--metrics-port", str(mport)])
        assert healthcheck.main(["http", f"http://127.0.0.1:{mport}/health"]) == 1
    finally:
        srv.shutdown()


def test_grpc_check_and_usage() -> None:
    with socket.socket() as s:  # nothing serves gRPC there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert healthcheck.main(["grpc", f"127.0.0.1:{port}"]) == 1
    assert healthcheck.check_role(["frontend", "--port", str(port)]) is False
    assert healthcheck.main(["bogus"]) == 2
