"""TLS, API keys, the per-key concurrency cap, loopback-only sockets, and
health that turns NOT_SERVING when the scheduler is lost. The four
components are started one by one here (``pagedserve serve`` checks health
over plaintext, so it cannot front a TLS-only frontend), with the tiny-Llama
tokenizer and the SIMULATED worker."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e_util import free_port
from models import make_tiny_model
from pagedserve.client import GenerationClient
from pagedserve.common.config import default_addresses

KEY_A = "key-alpha-0123456789"
KEY_B = "key-bravo-9876543210"


def make_cert(folder: Path) -> tuple[str, str]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


@dataclass
class Stack:
    procs: dict[str, subprocess.Popen[bytes]]
    addr: str
    http: str
    cert: bytes
    cert_file: str

    def client(self, key: str | None = KEY_A) -> GenerationClient:
        return GenerationClient(self.addr, api_key=key, tls=self.cert)

    def health(self) -> int:
        ch = grpc.secure_channel(self.addr, grpc.ssl_channel_credentials(self.cert))
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        finally:
            ch.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("sec")
    model_dir = make_tiny_model(tmp, "llama", seed=0)
    cert, key = make_cert(tmp)
    keyfile = tmp / "keys"
    keyfile.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    run = tmp / "run"
    a = default_addresses(str(run))
    port, http = free_port(), free_port()
    common = ["--model", model_dir, "--worker", "sim", "--num-gpu-blocks", "1024", "--max-model-len", "8192",
              "--scheduler-in", a.scheduler_in, "--scheduler-out", a.scheduler_out, "--blockmgr-addr", a.blockmgr,
              "--worker-addr", a.worker]
    frontend = ["--port", str(port), "--http-port", str(http), "--tls-cert", cert, "--tls-key", key,
                "--api-key-file", str(keyfile), "--max-concurrent-per-key", "2", "--health-interval", "0.3",
                "--health-timeout", "1.5"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in ("blockmgr", "gpuworker", "scheduler", "frontend"):
            extra = frontend if name == "frontend" else []
            procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve", name, *common, *extra],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        s = Stack(procs, f"127.0.0.1:{port}", f"https://127.0.0.1:{http}", Path(cert).read_bytes(), cert)
        deadline = time.monotonic() + 120
        while True:
            try:
                if s.health() == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), "did not start"
            time.sleep(0.2)
        yield s
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_request_without_key_is_refused_and_with_key_served_over_tls(stack: Stack) -> None:
    for key in (None, "wrong-key-000000000"):
        with stack.client(key) as c:
            for call in (lambda: c.generate("Hello", max_tokens=2), c.server_info, c.model_info,
                         lambda: c.tokenize("hi"), lambda: c.abort("x")):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
    for key in (KEY_A, KEY_B):
        with stack.client(key) as c:
            ids, _, reason = c.generate("Hello", max_tokens=4, temperature=0.0)
            assert len(ids) == 4 and reason == "length"
            info = c.server_info()
            assert info.auth_enabled and info.tls_enabled
    # Plaintext to the TLS port gets nowhere.
    with GenerationClient(stack.addr, api_key=KEY_A) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Health stays open (load balancers carry no key).
    assert stack.health() == health_pb2.HealthCheckResponse.SERVING


def test_http_gateway_requires_the_key_over_tls(stack: Stack) -> None:
    ctx = ssl.create_default_context(cafile=stack.cert_file)
    body = json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()

    def post(key: str | None) -> tuple[int, dict[str, object]]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(stack.http + "/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, context=ctx) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    status, out = post(None)
    assert status == 401 and out["error"]["code"] == 401  # type: ignore[index]
    status, out = post(KEY_B)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    with urllib.request.urlopen(stack.http + "/health", context=ctx) as r:
        assert r.status == 200


def test_per_key_concurrency_cap(stack: Stack) -> None:
    with stack.client(KEY_A) as a, stack.client(KEY_B) as b:
        held = [a.stream("Hello", max_tokens=8000, temperature=0.0, ignore_eos=True) for _ in range(2)]
        for s in held:
            next(s)
        with pytest.raises(grpc.RpcError) as err:
            a.generate("Hello", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_per_key=2" in err.value.details()
        ids, _, _ = b.generate("Hello", max_tokens=3, temperature=0.0)  # another tenant is unaffected
        assert len(ids) == 3
        held[0].cancel()
        time.sleep(0.2)
        ids, _, _ = a.generate("Hello", max_tokens=3, temperature=0.0)  # a slot came back
        assert len(ids) == 3
        held[1].cancel()


def _listening_tcp(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.append(cols[1])
    return out


def test_every_socket_is_ipc_or_loopback(stack: Stack) -> None:
    for addr in (default_addresses().scheduler_in, default_addresses().worker):
        assert addr.startswith("ipc://")
    listening = _listening_tcp([p.pid for p in stack.procs.values()])
    assert len(listening) >= 2  # gRPC and HTTP
    for local in listening:
        host = _proc_ip(local.split(":")[0])
        loopback = host.is_loopback or (host.version == 6 and host.ipv4_mapped is not None
                                        and host.ipv4_mapped.is_loopback)
        assert loopback, f"listening beyond loopback: {host}"


def _proc_ip(hexaddr: str) -> "ipaddress.IPv4Address | ipaddress.IPv6Address":
    # /proc/net/tcp{,6}: the address as 32-bit words in host (little-endian) order.
    raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1] for i in range(0, len(hexaddr), 8))
    return ipaddress.ip_address(raw)


def test_health_goes_not_serving_when_the_scheduler_is_lost(stack: Stack) -> None:
    """Last in the module: it kills the scheduler."""
    with stack.client(KEY_B) as c:
        stream = c.stream("Hello", max_tokens=8000, temperature=0.0, ignore_eos=True)
        next(stream)
        errors: list[grpc.RpcError] = []

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=drain)
        t.start()
        stack.procs["scheduler"].kill()
        t0 = time.monotonic()
        while stack.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - t0 < 10, "health still SERVING after the scheduler died"
            time.sleep(0.1)
        t.join(10)
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE  # the open stream ended, not hung
        with pytest.raises(grpc.RpcError) as err:
            c.generate("Hello", max_tokens=2, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
