"""The KV event transport of vLLM 0.32's ``ZmqEventPublisher``: each batch
goes out on a PUB socket as ``(topic, seq as 8 bytes big-endian, msgpack
payload)``, sequence numbers from 0 with no gap; the last ``buffer_steps``
payloads are kept, and a ROUTER socket answers a replay request (the first
wanted seq, 8 bytes big-endian) with every kept batch from there, then the
end marker ``(b"", seq -1, b"")``.

Unlike vLLM's, this one runs in the blockmgr's own loop (no thread): the
loop calls ``serve_replay`` between messages, and ``publish`` after each."""
from __future__ import annotations

import logging
from collections import deque

import msgspec
import zmq

from pagedserve.blockmgr.kv_events import KVEventBatch
from pagedserve.common.kv_events_config import KVEventsConfig

log = logging.getLogger("pagedserve.blockmgr")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest.
    A loopback address is bound too (our default endpoint is one)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://0.0.0.0:")))


class KVEventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], cfg: KVEventsConfig) -> None:
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encode = msgspec.msgpack.Encoder().encode
        self._next_seq = 0
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _is_bind_endpoint(cfg.endpoint):
            self._pub.bind(cfg.endpoint)
        else:
            self._pub.connect(cfg.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if cfg.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
        log.info("KV events on %s (replay %s)", cfg.endpoint, cfg.replay_endpoint or "off")

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, batch: KVEventBatch) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = self._encode(batch)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the subscriber replays what it missed
            log.warning("KV event batch %d dropped at the PUB high-water mark (kept for replay)", seq)

    def serve_replay(self) -> None:
        """Answer the replay requests waiting (never blocks)."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("malformed KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
