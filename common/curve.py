"""Optional CurveZMQ encryption for internal sockets on tcp:// (components on
different hosts). ``pagedserve keygen DIR`` writes a server keypair; point
every component at it with ``PAGEDSERVE_CURVE_KEYS=DIR``. Bound sockets then
act as CURVE servers, and connecting sockets must know the server's public
key (each uses a fresh client keypair), so traffic is encrypted and a peer
without the key cannot join. ipc:// sockets stay plain: they never leave the host.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import zmq
import zmq.auth

ENV = "PAGEDSERVE_CURVE_KEYS"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


@lru_cache(maxsize=4)
def load(directory: str) -> CurveKeys:
    public, secret = zmq.auth.load_certificate(os.path.join(directory, "server.key_secret"))
    if secret is None:
        raise ValueError(f"{directory}/server.key_secret holds no secret key")
    return CurveKeys(public, secret)


def from_env() -> CurveKeys | None:
    directory = os.environ.get(ENV)
    return load(directory) if directory else None


def secure(sock: zmq.Socket[Any], addr: str, bind: bool, keys: CurveKeys | None) -> None:
    """Turn CURVE on for a tcp:// socket before it binds or connects."""
    if keys is None or not addr.startswith("tcp://"):
        return
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
    """pagedserve keygen DIR: write server.key and server.key_secret into DIR."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: pagedserve keygen DIR", file=sys.stderr)
        return 2
    os.makedirs(argv[0], mode=0o700, exist_ok=True)
    zmq.auth.create_certificates(argv[0], "server")
    os.chmod(os.path.join(argv[0], "server.key_secret"), 0o600)
    print(f"wrote {argv[0]}/server.key and server.key_secret; set {ENV}={argv[0]} for every component")
    return 0
