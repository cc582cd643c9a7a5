"""Physical KV blocks, their reference counts and an O(1) free-block queue.

The free queue is a doubly linked list whose links live in the blocks
themselves (as in vLLM v1), so a block can leave the queue from the middle
in O(1) when a prefix-cache lookup revives it. The head is allocated (and,
if it still holds a cached hash, evicted) first:

* a freed block that holds a cached hash goes to the tail, so cached blocks
  are evicted least-recently-freed first; a sequence frees its table in
  reverse, so the tail of a hash chain is evicted before its head;
* a freed block without a hash goes to the head: it holds nothing worth
  keeping, so it is reused before any cached block.

Within one scheduler step, a block whose content a copy of the step still
reads or writes (a copy-on-write source or destination, a CPU block a
swap-in reads) is *held* instead of freed when its last reference goes, and
returns to the queue at the next step: the worker runs all of a step's
copies as three batches, so reusing such a block in the same step could
race with them.
"""
from __future__ import annotations

from pagedserve.blockmgr.kv_events import KVEventLog


class Block:
    """One physical block. ``block_hash`` is set only while the block is
    registered in the prefix cache; ``pending_hash`` while its K/V is being
    written by the current step (it becomes cached at the next step)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "pending_hash", "prev", "next", "held")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.pending_hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None
        self.held = False  # freed this step, back in the queue next step

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with two sentinel nodes."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)  # sentinels: never handed out, never on the wire
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.push_tail(b)

    def push_tail(self, b: Block) -> None:
        last = self._tail.prev
        assert last is not None
        b.prev, b.next = last, self._tail
        last.next = b
        self._tail.prev = b
        self.num_free += 1

    def push_head(self, b: Block) -> None:
        first = self._head.next
        assert first is not None
        b.prev, b.next = self._head, first
        first.prev = b
        self._head.next = b
        self.num_free += 1

    def pop_head(self) -> Block:
        b = self._head.next
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: Block) -> None:
        prev, nxt = b.prev, b.next
        if prev is None or nxt is None:
            raise AssertionError(f"block {b.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        b.prev = b.next = None
        self.num_free -= 1

    def __iter__(self):  # head (evicted first) to tail
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """A pool of ``num_blocks`` blocks; ids below ``first_usable`` are
    reserved (the GPU pool reserves block 0 as the null block)."""

    def __init__(self, num_blocks: int, first_usable: int = 0, medium: str = "GPU",
                 events: KVEventLog | None = None) -> None:
        if num_blocks < first_usable:
            raise ValueError(f"pool of {num_blocks} blocks cannot reserve {first_usable}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.first_usable = first_usable
        self.num_usable = num_blocks - first_usable
        self.free = FreeBlockQueue(self.blocks[first_usable:])
        self.cached: dict[bytes, Block] = {}  # prefix cache: chained hash -> block
        self.num_shared_refs = 0  # sum over blocks of max(ref_cnt - 1, 0)
        self.hold_ids: set[int] = set()  # blocks a copy of this step touches
        self.held: list[Block] = []  # of those, the ones freed this step
        self.medium = medium  # what KV events call this pool
        self.events = events  # hears every change of ``cached`` (None: events off)

    @property
    def num_free(self) -> int:
        return self.free.num_free

    def take(self) -> Block:
        """Pop a free block for new content; evicts its cached hash if any."""
        b = self.free.pop_head()
        if b.block_hash is not None:
            del self.cached[b.block_hash]
            if self.events is not None:
                self.events.removed(b.block_hash, self.medium)
            b.block_hash = None
        b.ref_cnt = 1
        return b

    def ref(self, b: Block) -> None:
        """One more table holds ``b`` (revives a cached free block)."""
        if b.ref_cnt == 0:
            if b.held:
                b.held = False
                self.held.remove(b)
            else:
                self.free.remove(b)
        else:
            self.num_shared_refs += 1
        b.ref_cnt += 1

    def unref(self, b: Block) -> None:
        b.ref_cnt -= 1
        if b.ref_cnt > 0:
            self.num_shared_refs -= 1
            return
        if b.ref_cnt < 0:
            raise AssertionError(f"block {b.block_id} ref count below zero")
        b.pending_hash = None  # its K/V will not be written after all
        if b.block_id in self.hold_ids:
            b.held = True
            self.held.append(b)
        elif b.block_hash is not None:
            self.free.push_tail(b)
        else:
            self.free.push_head(b)

    def end_step(self) -> None:
        """The step's copies have run: held blocks become free."""
        for b in self.held:
            b.held = False
            if b.block_hash is not None:
                self.free.push_tail(b)
            else:
                self.free.push_head(b)
        self.held = []
        self.hold_ids.clear()

    def commit(self, b: Block) -> None:
        """Register ``b``'s pending hash in the prefix cache (first wins)."""
        h = b.pending_hash
        b.pending_hash = None
        if h is not None and b.ref_cnt > 0 and b.block_hash is None and h not in self.cached:
            self.register(b, h)

    def register(self, b: Block, key: bytes) -> None:
        """``b`` holds the content keyed ``key`` from now on."""
        b.block_hash = key
        self.cached[key] = b
        if self.events is not None:
            self.events.stored(key, self.medium)

    def check(self, name: str, expected_refs: dict[int, int]) -> None:
        """Integrity: free + used == usable, ref counts exact, cache coherent."""
        free_ids: set[int] = set()
        for b in self.free:
            if b.block_id in free_ids:
                raise AssertionError(f"{name}: block {b.block_id} twice in the free queue")
            if b.ref_cnt != 0:
                raise AssertionError(f"{name}: free block {b.block_id} has ref count {b.ref_cnt}")
            if b.block_id < self.first_usable:
                raise AssertionError(f"{name}: reserved block {b.block_id} in the free queue")
            free_ids.add(b.block_id)
        if len(free_ids) != self.free.num_free:
            raise AssertionError(f"{name}: free counter {self.free.num_free} != {len(free_ids)} queued")
        held_ids = {b.block_id for b in self.held}
        for b in self.held:
            if b.ref_cnt != 0 or not b.held or b.block_id in free_ids:
                raise AssertionError(f"{name}: held block {b.block_id} is in use or also free")
        used = 0
        shared = 0
        for b in self.blocks[self.first_usable:]:
            want = expected_refs.get(b.block_id, 0)
            if b.ref_cnt != want:
                raise AssertionError(f"{name}: block {b.block_id} ref count {b.ref_cnt}, held by {want} tables")
            if want == 0 and b.block_id not in free_ids and b.block_id not in held_ids:
                raise AssertionError(f"{name}: block {b.block_id} leaked (no holder, not free)")
            if want > 0:
                used += 1
                shared += want - 1
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise AssertionError(f"{name}: block {b.block_id} hash not in the cache map")
        for b in self.blocks[: self.first_usable]:
            if b.ref_cnt or b.block_id in expected_refs:
                raise AssertionError(f"{name}: reserved block {b.block_id} is in use")
        if used + len(free_ids) + len(held_ids) != self.num_usable:
            raise AssertionError(f"{name}: used {used} + free {len(free_ids)} + held {len(held_ids)} "
                                 f"!= usable {self.num_usable}")
        if shared != self.num_shared_refs:
            raise AssertionError(f"{name}: shared-ref counter {self.num_shared_refs} != {shared}")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"{name}: cache entry points at block {b.block_id} with another hash")
