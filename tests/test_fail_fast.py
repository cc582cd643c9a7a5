"""Issue 19: a component checks its security configuration and its internal
addresses right after parsing its arguments, before it loads anything. The
gpuworker used to refuse tcp:// without CurveZMQ keys only after loading the
model (73 s); now the real component, started as compose starts it, exits
with status 2 and one line within its import time, and the model cache stays
empty. The scheduler and the frontend call the same ``check_addresses``."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq.auth

from pagedserve.common import curve
from pagedserve.common.config import Addresses, check_addresses

MARGIN_S = 3.0  # over the bare import time: argument parsing and the check itself


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    # An empty model cache: had the default model been converted or loaded, it would be filled.
    env["PAGEDSERVE_CACHE"] = str(tmp_path / "cache")
    (tmp_path / "cache").mkdir(exist_ok=True)
    return {**env, **extra}


def import_seconds(component: str, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import pagedserve.cli, pagedserve.{component}.service"], env=env,
                   check=True, capture_output=True, timeout=120)
    return time.monotonic() - t0


def start(component: str, args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pagedserve", component, *args], env=env, capture_output=True,
                         text=True, timeout=120)
    return out, time.monotonic() - t0


def assert_refused(out: subprocess.CompletedProcess[str], component: str, *says: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"pagedserve {component}: error: "), out.stderr[-3000:]
    for s in says:
        assert s in lines[-1], (s, lines[-1])
    return lines[-1]


def write_keys(folder: Path) -> Path:
    assert curve.main([str(folder)]) == 0
    return folder


OPT = {"blockmgr": "--blockmgr-addr", "gpuworker": "--worker-addr", "scheduler": "--scheduler-in",
       "frontend": "--scheduler-in"}


@pytest.mark.parametrize("component", ["gpuworker", "blockmgr", "scheduler", "frontend"])
def test_plain_tcp_is_refused_within_the_import_time(component: str, tmp_path: Path) -> None:
    """The default model (no --model): loading it would take a minute and fill the cache."""
    env = clean_env(tmp_path)
    baseline = import_seconds(component, env)
    out, took = start(component, [OPT[component], f"tcp://127.0.0.1:{free_port()}"], env)
    line = assert_refused(out, component, "without CurveZMQ keys", curve.ENV, "--insecure-internal-tcp")
    print(f"\n{component}: refused in {took:.2f} s (bare import {baseline:.2f} s): {line[:90]}...")
    assert took < baseline + MARGIN_S, f"{took:.1f} s: more than importing ({baseline:.1f} s)"
    assert not any((tmp_path / "cache").iterdir()), "the model was touched before the check"
    assert "serving on" not in out.stderr and "listening" not in out.stderr


def test_the_worker_checks_before_it_looks_for_its_model(tmp_path: Path) -> None:
    """A model that is not there: the security refusal comes first (it would be
    'failed to start: ModelNotFound' had the worker begun loading)."""
    out, _ = start("gpuworker", ["--model", str(tmp_path / "no-such-model"), "--worker-addr",
                                 f"tcp://127.0.0.1:{free_port()}"], clean_env(tmp_path))
    assert_refused(out, "gpuworker", "without CurveZMQ keys")
    assert "no-such-model" not in out.stderr


def _malformed(folder: Path) -> Path:
    folder.mkdir()
    (folder / "server.key_secret").write_text("this is not a certificate\n")
    return folder


def _mismatched(folder: Path) -> Path:
    write_keys(folder)
    other_public, _ = zmq.curve_keypair()
    text = (folder / "server.key_secret").read_text()
    public, _ = zmq.auth.load_certificate(str(folder / "server.key_secret"))
    (folder / "server.key_secret").write_text(text.replace(public.decode(), other_public.decode()))
    return folder


def _unreadable(folder: Path) -> Path:
    write_keys(folder)
    (folder / "server.key_secret").chmod(0)
    return folder


BAD_KEYS = {
    "missing": (lambda f: f, "no such file"),
    "malformed": (_malformed, "cannot use the CurveZMQ keys"),
    "mismatched": (_mismatched, "the public key is not the secret key's"),
}


# Each case on the quick blockmgr; one on the gpuworker (5 s of imports per start on a busy machine).
@pytest.mark.parametrize("component,case", [*(("blockmgr", c) for c in sorted(BAD_KEYS)), ("gpuworker", "malformed")])
def test_keys_that_cannot_be_used_are_refused_at_start(component: str, case: str, tmp_path: Path) -> None:
    make, says = BAD_KEYS[case]
    keys = make(tmp_path / "keys")
    out, _ = start(component, [OPT[component], f"tcp://127.0.0.1:{free_port()}"],
                   clean_env(tmp_path, PAGEDSERVE_CURVE_KEYS=str(keys)))
    assert_refused(out, component, curve.ENV, says)
    assert not any((tmp_path / "cache").iterdir())


BAD_ADDRESSES = [("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
                 ("tcp://127.0.0.1:99999", "not a number in 0-65535"),
                 ("udp://127.0.0.1:5", "expected ipc://PATH or tcp://HOST:PORT"),
                 ("ipc://", "empty ipc:// path")]


@pytest.mark.parametrize("component,addr,says", [*(("blockmgr", a, s) for a, s in BAD_ADDRESSES),
                                                 ("gpuworker", *BAD_ADDRESSES[0])])
def test_an_address_that_does_not_parse_is_refused_at_start(component: str, addr: str, says: str,
                                                            tmp_path: Path) -> None:
    out, _ = start(component, [OPT[component], addr], clean_env(tmp_path))
    assert_refused(out, component, "does not parse", says)


def test_check_addresses_covers_what_each_role_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(curve.ENV, raising=False)
    monkeypatch.delenv(curve.INSECURE_ENV, raising=False)
    run = f"ipc://{tmp_path}"
    local = Addresses(f"{run}/in.sock", f"{run}/out.sock", f"{run}/bm.sock", f"{run}/wk.sock")
    for role in ("frontend", "scheduler", "blockmgr", "gpuworker"):
        check_addresses(local, role)  # ipc:// needs no keys
    remote_worker = dataclasses.replace(local, worker="tcp://gpuworker:5558")
    check_addresses(remote_worker, "frontend")  # not an address the frontend opens
    check_addresses(remote_worker, "blockmgr")
    for role in ("scheduler", "gpuworker"):
        with pytest.raises(curve.InsecureTransport, match="tcp://gpuworker:5558"):
            check_addresses(remote_worker, role)
    with pytest.raises(curve.BadInternalConfig, match="does not parse"):
        check_addresses(dataclasses.replace(local, scheduler_in="tcp://scheduler"), "frontend")
    monkeypatch.setenv(curve.INSECURE_ENV, "1")  # the explicit opt-out
    check_addresses(remote_worker, "scheduler")
    monkeypatch.delenv(curve.INSECURE_ENV)
    monkeypatch.setenv(curve.ENV, str(write_keys(tmp_path / "keys")))
    check_addresses(remote_worker, "scheduler")  # good keys
    # Keys are read only when a tcp:// socket needs them: a broken folder does not stop ipc://.
    monkeypatch.setenv(curve.ENV, str(tmp_path / "nowhere"))
    check_addresses(local, "scheduler")
    with pytest.raises(curve.BadInternalConfig, match="no such file"):
        check_addresses(remote_worker, "gpuworker")


def test_unreadable_keys_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _unreadable(tmp_path / "keys")
    if os.access(keys / "server.key_secret", os.R_OK):
        pytest.skip("running as root: a mode-0 file is still readable")
    monkeypatch.setenv(curve.ENV, str(keys))
    with pytest.raises(curve.BadInternalConfig, match="permission denied"):
        curve.check_security(["tcp://127.0.0.1:5555"])


def test_a_component_waits_for_keys_a_keygen_beside_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose starts the one-shot keygen beside the four (one `up`, no depends_on on an exited
    container): with PAGEDSERVE_CURVE_KEYS_WAIT a component waits for the keys instead of refusing."""
    keys = tmp_path / "keys"
    monkeypatch.setenv(curve.ENV, str(keys))
    with pytest.raises(curve.BadInternalConfig, match="no such file"):
        curve.check_security(["tcp://127.0.0.1:5555"])  # no wait: refused at once
    monkeypatch.setenv(curve.WAIT_ENV, "0.5")
    t0 = time.monotonic()
    with pytest.raises(curve.BadInternalConfig, match="no such file"):
        curve.check_security(["tcp://127.0.0.1:5555"])  # nobody writes them: refused after the wait
    assert time.monotonic() - t0 >= 0.5
    monkeypatch.setenv(curve.WAIT_ENV, "30")
    writer = threading.Timer(1.0, curve.main, args=([str(keys)],))
    writer.start()
    t0 = time.monotonic()
    curve.check_security(["tcp://127.0.0.1:5555"])
    writer.join()
    assert 1.0 <= time.monotonic() - t0 < 30
    assert sorted(p.name for p in keys.iterdir()) == ["server.key", "server.key_secret"]  # no temp left
    curve.load.cache_clear()
