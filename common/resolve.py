"""Host names of connecting tcp:// sockets: resolved here, and again when the peer moves.

A peer restarted under the same name at a new address (a compose container
after ``podman stop`` + ``start``) was never found by ZeroMQ's own reconnects
(issue 19: the frontend waited for ever). So a connecting socket whose tcp
host is a name (not an IP literal) connects to the address ``resolve_host``
gives. While a watched socket of that host is not connected (its peer
disconnected, a reconnect keeps failing, never connected yet), one background
thread resolves the name again, after 0.1 s doubling to 2 s; when the address
changed, each socket of the host follows in its own thread (ZeroMQ sockets
are not thread-safe): a sync socket at its next call, an asyncio one through
its event loop. The CurveZMQ server key, the heartbeats and a REQ's routing
id stay (a REQ is replaced by a new socket with the same options: ipc.py).

"Watched" sockets are those whose monitor this package reads (REQ, async
PUSH); a PULL's monitor belongs to its caller (the frontend), so it follows
the address found for the sockets watched for the same host, and a host with
no watched socket is resolved again every 2 s.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("pagedserve.ipc")
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
# What a watched socket's monitor reports: enough to tell connected from not.
WATCH_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED


def resolve_host(host: str) -> list[str]:
    """The addresses ``host`` has now, IPv4 first ([]: none). A module-level
    function so that tests can replace it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    found = list(dict.fromkeys(str(i[4][0]) for i in infos))
    return [a for a in found if ":" not in a] + [a for a in found if ":" in a]


def split_tcp(addr: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST without brackets, PORT); ValueError if it does not parse."""
    rest = addr[len("tcp://"):].rpartition(";")[2]  # ZeroMQ's SOURCE;HOST:PORT form
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError("expected tcp://HOST:PORT")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not a number in 0-65535 (or *)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"unclosed [ in host {host!r}")
        host = host[1:-1]
        ipaddress.IPv6Address(host)  # ValueError names it
    if any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"host {host!r} is not a host name or an address")
    return host, port


def check_address(addr: str) -> None:
    """Raises ValueError unless ``addr`` is an ``ipc://PATH`` or a ``tcp://HOST:PORT``."""
    scheme, sep, rest = addr.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ValueError("expected ipc://PATH or tcp://HOST:PORT")
    if scheme == "ipc" and not rest:
        raise ValueError("empty ipc:// path")
    if scheme == "tcp":
        split_tcp(addr)


def _is_name(host: str) -> bool:
    if host == "*":
        return False
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return True


def endpoint(ip: str, port: str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class _Host:
    def __init__(self, name: str, ip: str | None) -> None:
        self.name = name
        self.ip = ip
        self.links: list[Link] = []
        self.delay = BACKOFF_MIN_S
        self.due = time.monotonic() + BACKOFF_MIN_S

    def searching(self) -> bool:
        """Resolve again while a watched socket is not connected, or when none is watched."""
        watched = [link for link in self.links if link.watched]
        return not watched or any(not link.up for link in watched)


class Link:
    """Where one connecting socket of a host name talks to. The owner feeds it
    its monitor's events (``note``) and, when ``target`` names an endpoint,
    moves there and says so (``moved``)."""

    def __init__(self, host: _Host, port: str, watched: bool) -> None:
        self._host = host
        self.port = port
        self.watched = watched
        self.endpoint = endpoint(host.ip, port) if host.ip else f"tcp://{host.name}:{port}"
        self.up = False
        self.on_move: Callable[[], None] | None = None  # run by the resolver thread when the address changed

    def note(self, event: int, where: bytes | str) -> None:
        """A monitor event of the owner's socket (events of an endpoint left behind are ignored)."""
        if (where.decode() if isinstance(where, bytes) else where) != self.endpoint:
            return
        if event == zmq.EVENT_CONNECTED:
            self.up = True
        elif event & _DOWN and self.up:
            self.up = False
            _wake(self._host, reset=True)  # a fresh loss: start again at 0.1 s
            _notify(self._host)  # an address found while it was up may be followed now

    def target(self) -> str | None:
        """The endpoint to move to: the host's address changed, and this socket
        is not connected where it is. An unwatched one cannot tell, but a new
        address is looked for only while the host's watched sockets are down
        (or none is watched), so it follows at once, even if they reconnect first."""
        ip = self._host.ip
        if ip is None or endpoint(ip, self.port) == self.endpoint or (self.watched and self.up):
            return None
        return endpoint(ip, self.port)

    def moved(self, to: str) -> None:
        log.info("%s: %s moved: %s -> %s", self._host.name, self.port, self.endpoint, to)
        self.endpoint = to
        self.up = False

    def close(self) -> None:
        with _cond:
            if self in self._host.links:
                self._host.links.remove(self)
            if not self._host.links:
                _hosts.pop(self._host.name, None)


_hosts: dict[str, _Host] = {}
_cond = threading.Condition()
_thread: threading.Thread | None = None


def link(addr: str, watched: bool) -> Link | None:
    """A link for a connecting socket to ``addr``, or None when there is no
    name to resolve (ipc://, an IP literal, the SOURCE;HOST form): connect to
    ``addr`` as given. The first resolution happens here, in the caller; a name
    that does not resolve yet is connected as given until it does."""
    if not addr.startswith("tcp://") or ";" in addr:
        return None
    name, port = split_tcp(addr)
    if not _is_name(name):
        return None
    global _thread
    with _cond:
        host = _hosts.get(name)
    ip = next(iter(resolve_host(name)), None) if host is None else host.ip
    with _cond:
        host = _hosts.setdefault(name, _Host(name, ip))
        made = Link(host, port, watched)
        host.links.append(made)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="pagedserve-resolve", daemon=True)
            _thread.start()
        _cond.notify()
    return made


def _wake(host: _Host, reset: bool) -> None:
    with _cond:
        if reset:
            host.delay = BACKOFF_MIN_S
            host.due = time.monotonic() + BACKOFF_MIN_S
        _cond.notify()


def _run() -> None:
    """The resolver thread: only name look-ups and bookkeeping, never a socket call."""
    while True:
        with _cond:
            now = time.monotonic()
            hosts = [h for h in _hosts.values() if h.searching()]
            due = [h for h in hosts if h.due <= now]
            if not due:
                # Poll the watched state too: ``up`` changes in the owners' threads.
                _cond.wait(min([h.due - now for h in hosts] + [BACKOFF_MAX_S]))
                continue
            for h in due:
                h.due = now + h.delay
                h.delay = min(2 * h.delay, BACKOFF_MAX_S)
        for h in due:
            ips = resolve_host(h.name)
            with _cond:
                if not ips or h.ip in ips:  # one of several addresses: no reason to move
                    continue
                log.warning("%s now resolves to %s (was %s): following it", h.name, ips[0], h.ip)
                h.ip = ips[0]
            _notify(h)


def _notify(host: _Host) -> None:
    """Asks the owners that follow through a callback (asyncio) to look; the
    others look at their next call."""
    with _cond:
        calls = [link.on_move for link in host.links if link.on_move is not None]
    for call in calls:
        try:
            call()
        except RuntimeError:  # its event loop is closed: the socket is gone too
            pass


def connect(sock: zmq.Socket[Any], to: str) -> None:
    if to.startswith("tcp://[") and ":" in to[len("tcp://["):].partition("]")[0]:
        sock.setsockopt(zmq.IPV6, 1)  # an IPv6 literal
    sock.connect(to)


def follow(sock: zmq.Socket[Any], link: Link) -> bool:
    """Moves ``sock`` where ``link`` says, in the socket's own thread: the old
    endpoint is disconnected and the new one connected. (ZeroMQ finishes a
    disconnect only as the socket is used again, which these sockets are at
    once; until then the old session keeps reconnecting: ReqClient therefore
    takes a new socket, since such a session that reached our peer again
    would hold our routing id.)"""
    to = link.target()
    if to is None or sock.closed:
        return False
    try:
        sock.disconnect(link.endpoint)
    except zmq.ZMQError:
        pass  # gone already
    connect(sock, to)
    link.moved(to)
    return True
