"""CurveZMQ encryption for internal sockets on tcp:// (components on
different hosts). ``pagedserve keygen DIR`` writes a server keypair; point
every component at it with ``PAGEDSERVE_CURVE_KEYS=DIR``. Bound sockets then
act as CURVE servers, and connecting sockets must know the server's public
key (each uses a fresh client keypair), so traffic is encrypted and a peer
without the key cannot join. ipc:// sockets stay plain: they never leave the
host, and their folder is private (``rundir``).

A tcp:// socket without keys is refused (``InsecureTransport``), loopback
included: any local user can reach a loopback port. The explicit opt-out is
``--insecure-internal-tcp`` or ``PAGEDSERVE_INSECURE_INTERNAL_TCP=1``.

``check_security`` says so at start-up, right after argument parsing, before
a component loads anything (the model takes a minute): each address parses,
and tcp:// ones have readable, well-formed keys (or the opt-out).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import zmq
import zmq.auth
import zmq.utils.z85

from pagedserve.common import resolve
from pagedserve.common.env import PREFIX, env, env_flag

ENV = "PAGEDSERVE_CURVE_KEYS"
# Seconds to wait at start-up for keys another process is writing (compose's one-shot
# keygen service starts beside the components, not before them: podman cannot restart a
# container that `depends_on` one which has exited).
WAIT_ENV = "PAGEDSERVE_CURVE_KEYS_WAIT"
INSECURE_ENV = "PAGEDSERVE_INSECURE_INTERNAL_TCP"


class InsecureTransport(RuntimeError):
    """A tcp:// internal socket without CurveZMQ keys and without the opt-out."""


class BadInternalConfig(InsecureTransport):
    """CurveZMQ keys that cannot be read or are malformed, or an internal
    address that does not parse. A subclass so that the CLI reports it as one
    line and exit status 2, as it does InsecureTransport."""


def allow_insecure() -> None:
    """The ``--insecure-internal-tcp`` opt-out (also inherited by children)."""
    os.environ[INSECURE_ENV] = "1"


class AllowInsecureAction(argparse.Action):
    """``--insecure-internal-tcp``: sets the opt-out when parsed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        allow_insecure()
        setattr(namespace, self.dest, True)


def insecure_allowed() -> bool:
    return bool(env_flag(INSECURE_ENV.removeprefix(PREFIX), False))


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


@lru_cache(maxsize=4)
def load(directory: str) -> CurveKeys:
    path = os.path.join(directory, "server.key_secret")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    # Well formed: two Z85 keys of 32 bytes, the public one belonging to the secret one.
    try:
        if len(zmq.utils.z85.decode(public)) != 32 or len(zmq.utils.z85.decode(secret)) != 32:
            raise ValueError
        matches = zmq.curve_public(secret) == public
    except (ValueError, KeyError, IndexError, TypeError, zmq.ZMQError):
        raise ValueError(f"{path} does not hold 40-character Z85 CurveZMQ keys") from None
    if not matches:
        raise ValueError(f"{path}: the public key is not the secret key's")
    return CurveKeys(public, secret)


def from_env() -> CurveKeys | None:
    directory = env(ENV.removeprefix(PREFIX))
    return load(directory) if directory else None


def _refusal(addr: str) -> InsecureTransport:
    return InsecureTransport(
        f"internal socket {addr} is tcp:// without CurveZMQ keys: anyone who reaches the port could "
        f"send it commands. Run `pagedserve keygen DIR` and set {ENV}=DIR for every component, or opt "
        f"out explicitly with --insecure-internal-tcp ({INSECURE_ENV}=1)")


def check_security(addrs: Iterable[str]) -> None:
    """Fail fast, before anything loads: raises ``BadInternalConfig`` for an
    address that does not parse or keys that cannot be used, and
    ``InsecureTransport`` for tcp:// without keys and without the opt-out
    (what ``secure`` would raise later, once the socket is opened)."""
    addrs = list(addrs)
    for addr in addrs:
        try:
            resolve.check_address(addr)
        except ValueError as e:
            raise BadInternalConfig(f"internal address {addr!r} does not parse: {e}") from None
    tcp = [a for a in addrs if a.startswith("tcp://")]
    if not tcp:
        return  # ipc:// only: no keys needed, and unused ones are not read
    directory = env(ENV.removeprefix(PREFIX))
    if not directory:
        if insecure_allowed():
            return
        raise _refusal(tcp[0])
    path = os.path.join(directory, "server.key_secret")
    deadline = time.monotonic() + float(env(WAIT_ENV.removeprefix(PREFIX), 0))
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not os.access(path, os.R_OK):
        why = "permission denied" if os.path.exists(path) else "no such file"
        raise BadInternalConfig(f"{ENV}={directory}: cannot read {path} ({why}); `pagedserve keygen DIR` writes it")
    try:
        load(directory)
    except (OSError, ValueError) as e:
        raise BadInternalConfig(f"{ENV}={directory}: cannot use the CurveZMQ keys: {e}") from None


def secure(sock: zmq.Socket[Any], addr: str, bind: bool, keys: CurveKeys | None) -> None:
    """Turn CURVE on for a tcp:// socket before it binds or connects."""
    if not addr.startswith("tcp://"):
        return
    if keys is None:
        if insecure_allowed():
            return
        raise _refusal(addr)
    if bind:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    else:
        client_public, client_secret = zmq.curve_keypair()
        sock.curve_secretkey = client_secret
        sock.curve_publickey = client_public
        sock.curve_serverkey = keys.public


def main(argv: list[str]) -> int:
    """pagedserve keygen [--if-missing] DIR: write server.key and server.key_secret into DIR."""
    if_missing = "--if-missing" in argv
    argv = [a for a in argv if a != "--if-missing"]
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: pagedserve keygen [--if-missing] DIR", file=sys.stderr)
        return 2
    if if_missing and os.path.exists(os.path.join(argv[0], "server.key_secret")):
        print(f"{argv[0]}/server.key_secret exists; kept")
        return 0
    os.makedirs(argv[0], mode=0o700, exist_ok=True)
    # Written aside and renamed in, the secret last: a component waiting for the keys
    # (WAIT_ENV) never reads half a file.
    with tempfile.TemporaryDirectory(dir=argv[0], prefix=".keygen-") as tmp:
        zmq.auth.create_certificates(tmp, "server")
        os.chmod(os.path.join(tmp, "server.key_secret"), 0o600)
        for name in ("server.key", "server.key_secret"):
            os.replace(os.path.join(tmp, name), os.path.join(argv[0], name))
    print(f"wrote {argv[0]}/server.key and server.key_secret; set {ENV}={argv[0]} for every component")
    return 0
