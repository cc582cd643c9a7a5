"""Tensor-parallel plumbing: the rank group, its collectives, and how rank 0
hands each scheduler request to the other ranks.

Two process groups over one TCP rendezvous on 127.0.0.1 (rank 0 owns the
store; its port is passed to the other ranks on their command line):

  group    device collectives of the forward (NCCL on CUDA, gloo on CPU):
           the all-reduce after every row-parallel layer, the all-gather of
           vocab-parallel logits, the broadcast of sampled token ids.
  control  gloo, CPU tensors: rank 0 broadcasts every request it gets from
           the scheduler as msgpack bytes (a length, then a uint8 tensor), so
           every rank runs the same steps on the same state. Its timeout is
           effectively infinite because the other ranks wait here while the
           engine is idle; a rank that dies closes its sockets, which fails the
           peers' pending collective instead of hanging them.

No pickle: requests travel as msgspec msgpack, tensors as raw collectives.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pagedserve.common.messages import worker as wk

_IDLE_TIMEOUT = datetime.timedelta(days=3650)  # the control group waits for the scheduler, however long
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(wk.Request)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a CUDA group uses the r-th GPU after the configured one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (size 1: no group)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    control: Any = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 talks to the scheduler and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over ranks (pool sizes must agree)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape) along the last dim."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape on every rank)."""
        if self.size > 1:
            torch.distributed.broadcast(x, 0, group=self.group)
        return x

    def send_request(self, msg: wk.Request) -> None:
        """Rank 0: hand a scheduler request to the other ranks."""
        data = _encoder.encode(msg)
        torch.distributed.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.control)
        torch.distributed.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control)

    def recv_request(self) -> wk.Request:
        """Ranks > 0: the next request rank 0 got (blocks while the engine idles)."""
        n = torch.zeros(1, dtype=torch.int64)
        torch.distributed.broadcast(n, 0, group=self.control)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        torch.distributed.broadcast(buf, 0, group=self.control)
        return _decoder.decode(buf.numpy().tobytes())

    def destroy(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


SINGLE = TPGroup()


def _use_loopback() -> None:
    """Gloo picks its interface from the hostname, which may resolve to an
    address that is not reachable (containers, no network); the ranks are
    always on this machine, so use loopback unless told otherwise."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def create_store(size: int) -> torch.distributed.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return torch.distributed.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(minutes=30))


def init_group(rank: int, size: int, device: torch.device, port: int | None = None,
               store: torch.distributed.TCPStore | None = None) -> TPGroup:
    """Join the group: rank 0 passes the store it created, the others its port.
    Loading a large checkpoint can take long, so the rendezvous waits 30 min."""
    if size == 1:
        return SINGLE
    _use_loopback()
    if store is None:
        if port is None:
            raise ValueError("a rank > 0 needs the rendezvous port")
        store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=False,
                                           timeout=datetime.timedelta(minutes=30))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(minutes=30), **kwargs)
    group = torch.distributed.group.WORLD
    # Its own gloo group even on CPU: the idle-proof timeout must not apply to the forward's collectives.
    control = torch.distributed.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TPGroup(rank, size, group, control)


def split_range(total: int, tp: TPGroup) -> tuple[int, int]:
    """(start, size) of this rank's part of ``total`` items, as even as possible
    (used for MLP columns, which need not divide by the group size)."""
    start = total * tp.rank // tp.size
    return start, total * (tp.rank + 1) // tp.size - start


def head_range(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of this rank. Query
    heads must divide by the group size; KV heads divide it or are replicated
    (each rank keeps the one KV head its query heads read)."""
    n = tp.size
    if num_heads % n:
        raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor_parallel_size {n}")
    if num_kv_heads % n and n % num_kv_heads:
        raise ValueError(f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {n}: one must divide the other")
    q = num_heads // n
    if num_kv_heads >= n:
        kv = num_kv_heads // n
        return tp.rank * q, q, tp.rank * kv, kv
    return tp.rank * q, q, tp.rank * num_kv_heads // n, 1
