"""Property-based tests: random allocate/append/fork/free/swap/prefix-hit
sequences against BlockManager, with a simulated worker.

The simulated worker keeps one token id per KV slot. After each step it
applies the reply exactly as the real worker would (block-table diffs, then
swap_out, swap_in and CoW copies, then the forward pass writes the step's
tokens), so after every step each sequence's table must read back its own
tokens. That checks prefix-cache hits, CoW, swaps and the diffs end to end;
``check_integrity`` checks ownership and ref counts; writes assert that no
other sequence holds the block being written.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.messages.blockmgr import (
    Allocate,
    Append,
    Fork,
    Free,
    Status,
    StepRequest,
    SwapIn,
    SwapOut,
    answered_seq_ids,
)

# prompts share prefixes so that the prefix cache hits often
BASES = [[(7 * i + j) % 11 for j in range(40)] for i in range(3)]
tokens_st = st.lists(st.integers(0, 10), min_size=1, max_size=6)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        caching=st.booleans(),
        gpu=st.integers(3, 24),
        cpu=st.integers(0, 12),
        bs=st.sampled_from([1, 2, 4]),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, caching: bool, gpu: int, cpu: int, bs: int, watermark: float) -> None:
        self.m = BlockManager(gpu, cpu, bs, enable_prefix_caching=caching, watermark=watermark)
        self.bs = bs
        self.gpu_mem: dict[int, list[int | None]] = {i: [None] * bs for i in range(gpu)}
        self.cpu_mem: dict[int, list[int | None]] = {i: [None] * bs for i in range(cpu)}
        self.tokens: dict[int, list[int]] = {}  # tokens whose K/V is written
        self.tables: dict[int, list[int]] = {}  # GPU tables, rebuilt from the replies' diffs
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------

    def gpu_seqs(self) -> list[int]:
        return sorted(s for s in self.tokens if not self.m.seqs[s].on_cpu)

    def cpu_seqs(self) -> list[int]:
        return sorted(s for s in self.tokens if self.m.seqs[s].on_cpu)

    def snapshot(self) -> tuple:
        st_ = self.m.stats()
        return (st_.num_free_gpu_blocks, st_.num_free_cpu_blocks, st_.num_shared_block_refs,
                {s: (self.m.block_table(s), self.m.seqs[s].num_tokens) for s in self.m.seqs})

    def write(self, seq: int, start: int, toks: list[int], readers: set[int] = frozenset()) -> None:
        """The forward pass writes ``toks``; ``readers`` (children forked from
        ``seq`` after its Append this step) share the slots but never write them."""
        table = self.tables[seq]
        for i, t in enumerate(toks, start):
            b = table[i // self.bs]
            assert b != 0, "null block handed out"
            holders = [s for s, tb in self.tables.items() if s != seq and s not in readers and b in tb]
            assert not holders, f"seq {seq} writes block {b} shared with {holders}"
            self.gpu_mem[b][i % self.bs] = t

    def run(self, ops: list, writes: dict[int, tuple[str, list[int]]]) -> None:
        """One step. ``writes``: seq -> ("alloc", prompt) or ("append", tokens)."""
        self.run_rounds([(ops, writes)])

    def run_rounds(self, rounds: list) -> None:
        """One scheduler step sent as several requests (the later ones with
        ``continues_step``, as the scheduler does to preempt). A round is
        (ops, writes) or a function returning it once the previous rounds
        are applied. The worker gets the rounds' swap_out, swap_in and
        copies concatenated."""
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        writes: dict[int, tuple[str, list[int], object]] = {}
        forks: list[Fork] = []
        i = 0
        for rnd in rounds:
            ops, round_writes = rnd() if callable(rnd) else rnd
            if not ops:
                continue
            i += 1
            if i == 1:
                self.m.begin_step()  # (step() repeats it: harmless) so the snapshot sees held blocks freed
            before = self.snapshot()
            reply = self.m.step(StepRequest(ops, continues_step=i > 1))
            self.m.check_integrity()
            names = [sid for op in ops for sid in answered_seq_ids(op)]
            assert len(reply.results) == len(names), "results pair one to one with the ops' sequences"
            by_seq = {}
            for sid, r in zip(names, reply.results):
                if r is None:  # applied, table unchanged
                    continue
                assert r.seq_id == sid and sid not in by_seq
                by_seq[sid] = r
            # FCFS: after the first NO_ROOM, every later Allocate/SwapIn is NO_ROOM
            blocked = False
            for op in ops:
                ids = [op.seq_id] if isinstance(op, (Allocate, Append)) else getattr(op, "seq_ids", [])
                for s in ids:
                    r = by_seq.get(s)
                    if blocked and isinstance(op, (Allocate, SwapIn)):
                        assert r is not None and r.status is Status.NO_ROOM
                    if r is not None and r.status is Status.NO_ROOM:
                        blocked = True
            if len(ops) == 1 and by_seq and all(r.status is Status.NO_ROOM for r in by_seq.values()):
                assert self.snapshot() == before, "a NO_ROOM op changed the manager"
            # the scheduler's view: apply table diffs
            for r in by_seq.values():
                if r.status is Status.OK:
                    self.tables.setdefault(r.seq_id, [])[r.table_start:] = r.block_ids
            # a swap moves each distinct block once: sharing inside the group survives
            for op in ops:
                if isinstance(op, (SwapOut, SwapIn)) and by_seq[op.seq_ids[0]].status is Status.OK:
                    pairs = {(o, n) for s in op.seq_ids for o, n in zip(before[3][s][0], self.m.block_table(s))}
                    assert len({o for o, _ in pairs}) == len({n for _, n in pairs}), pairs
            for op in ops:  # a sequence preempted after its Append does not run this step
                if isinstance(op, SwapOut) and by_seq[op.seq_ids[0]].status is Status.OK:
                    for x in op.seq_ids:
                        writes.pop(x, None)
            swap_out += reply.swap_out
            swap_in += reply.swap_in
            copies += reply.copies
            for seq, (kind, toks) in round_writes.items():
                r = by_seq.get(seq)
                if r is not None and r.status is Status.NO_ROOM:
                    if kind == "alloc":
                        del self.tables[seq]
                    continue
                writes[seq] = (kind, toks, r)
            forks += [op for op in ops if isinstance(op, Fork)]
        for seq in [x for x in self.tables if x not in self.m.seqs]:  # freed this step
            del self.tables[seq]
            self.tokens.pop(seq, None)
        # the worker: swap out, swap in, copy-on-write, then the forward pass
        for g, c in swap_out:
            self.cpu_mem[c] = list(self.gpu_mem[g])
        for c, g in swap_in:
            self.gpu_mem[g] = list(self.cpu_mem[c])
        for src, dst in copies:
            self.gpu_mem[dst] = list(self.gpu_mem[src])
        # sequences freed or swapped out by a later round do not run
        writes = {s: w for s, w in writes.items() if s in self.m.seqs and not self.m.seqs[s].on_cpu}
        # a prefix-cache hit must read K/V written by an earlier step's forward
        for seq, (kind, toks, r) in writes.items():
            if kind == "alloc":
                table = self.tables[seq]
                got = [self.gpu_mem[table[i // self.bs]][i % self.bs] for i in range(r.num_cached_tokens)]
                assert got == toks[: r.num_cached_tokens], "cache hit on K/V not yet written"
        for seq, (kind, toks, r) in writes.items():
            if kind == "alloc":
                n = r.num_cached_tokens + r.num_scheduled_tokens
                assert r.num_cached_tokens % self.bs == 0 and r.num_cached_tokens < len(toks)
                self.tokens[seq] = toks[:n]
                self.write(seq, r.num_cached_tokens, toks[r.num_cached_tokens:n])
            else:
                start = len(self.tokens[seq])
                self.tokens[seq] += toks
                self.write(seq, start, toks, {f.child_seq_id for f in forks if f.parent_seq_id == seq})
        for op in forks:
            if op.child_seq_id in self.m.seqs:
                self.tokens[op.child_seq_id] = list(self.tokens[op.parent_seq_id])

    # ---- rules --------------------------------------------------------------

    @rule(base=st.integers(0, 2), n=st.integers(1, 40), suffix=st.lists(st.integers(0, 10), max_size=5),
          chunk=st.integers(0, 40), salt=st.sampled_from([None, None, "tenant"]))
    def allocate(self, base: int, n: int, suffix: list[int], chunk: int, salt: str | None) -> None:
        prompt = BASES[base][:n] + suffix
        seq = self.next_id
        self.next_id += 1
        self.tables[seq] = []
        num_new = chunk if chunk else len(prompt)
        self.run([Allocate(seq, prompt, num_new, salt)], {seq: ("alloc", prompt)})

    @precondition(lambda self: self.gpu_seqs())
    @rule(pick=st.integers(0, 1000), toks=tokens_st)
    def append(self, pick: int, toks: list[int]) -> None:
        seqs = self.gpu_seqs()
        seq = seqs[pick % len(seqs)]
        self.run([Append(seq, toks)], {seq: ("append", toks)})

    @precondition(lambda self: self.gpu_seqs())
    @rule(pick=st.integers(0, 1000))
    def fork(self, pick: int) -> None:
        seqs = self.gpu_seqs()
        parent = seqs[pick % len(seqs)]
        child = self.next_id
        self.next_id += 1
        self.run([Fork(parent, child)], {})

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        seqs = sorted(self.tokens)
        seq = seqs[pick % len(seqs)]
        self.run([Free(seq)], {})
        self.tokens.pop(seq, None)

    @precondition(lambda self: self.gpu_seqs())
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=4))
    def swap_out(self, picks: list[int]) -> None:
        seqs = self.gpu_seqs()
        group = sorted({seqs[p % len(seqs)] for p in picks})
        self.run([SwapOut(group)], {})

    @precondition(lambda self: self.cpu_seqs())
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=4))
    def swap_in(self, picks: list[int]) -> None:
        seqs = self.cpu_seqs()
        group = sorted({seqs[p % len(seqs)] for p in picks})
        self.run([SwapIn(group)], {})

    @rule(base=st.integers(0, 2), n=st.integers(1, 40), toks=st.lists(st.integers(0, 10), min_size=1, max_size=3),
          admit=st.integers(0, 2))
    def decode_step(self, base: int, n: int, toks: list[int], admit: int) -> None:
        """A realistic step: every running sequence decodes, then admissions."""
        ops: list = []
        writes: dict[int, tuple[str, list[int]]] = {}
        for seq in self.gpu_seqs():
            ops.append(Append(seq, toks))
            writes[seq] = ("append", toks)
        for _ in range(admit):
            seq = self.next_id
            self.next_id += 1
            prompt = BASES[base][:n]
            ops.append(Allocate(seq, prompt, len(prompt)))
            writes[seq] = ("alloc", prompt)
            self.tables[seq] = []
        if self.cpu_seqs():
            ops.append(SwapIn(self.cpu_seqs()[:1]))
        self.run(ops, writes)

    @precondition(lambda self: len(self.gpu_seqs()) >= 2)
    @rule(pick=st.integers(0, 1000), base=st.integers(0, 2), n=st.integers(1, 40),
          toks=st.lists(st.integers(0, 10), min_size=1, max_size=5))
    def preempt_step(self, pick: int, base: int, n: int, toks: list[int]) -> None:
        """Swap out one sequence, let the others grow and admit a new one in
        the same step: freed blocks are reused within the step."""
        seqs = self.gpu_seqs()
        victim = seqs[pick % len(seqs)]
        ops: list = [SwapOut([victim])]
        writes: dict[int, tuple[str, list[int]]] = {}
        for seq in seqs:
            if seq != victim:
                ops.append(Append(seq, toks))
                writes[seq] = ("append", toks)
        seq = self.next_id
        self.next_id += 1
        prompt = BASES[base][:n]
        ops.append(Allocate(seq, prompt, len(prompt)))
        writes[seq] = ("alloc", prompt)
        self.tables[seq] = []
        self.run(ops, writes)

    @precondition(lambda self: self.tokens)
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3), toks=st.lists(st.integers(0, 10), min_size=1, max_size=3),
          fork=st.booleans(), swap=st.booleans(), swap_in_first=st.booleans(), readmit=st.booleans(),
          n=st.integers(1, 12))
    def preemption_rounds(self, picks: list[int], toks: list[int], fork: bool, swap: bool, swap_in_first: bool,
                          readmit: bool, n: int) -> None:
        """Rounds of one step, as the scheduler sends them: maybe a swap-in;
        appends to every running sequence (maybe a fork); a preemption by
        swap-out or free; maybe another swap-in and an admission reusing the
        blocks just released. Exercises blocks freed and reused within a
        step while its copies are still pending."""
        family: dict[int, set[int]] = {}

        def round0() -> tuple[list, dict]:
            return ([SwapIn(self.cpu_seqs()[:1])] if swap_in_first and self.cpu_seqs() else []), {}

        def round1() -> tuple[list, dict]:
            ops: list = []
            writes: dict[int, tuple[str, list[int]]] = {}
            running = [x for x in sorted(self.m.seqs) if not self.m.seqs[x].on_cpu]
            for seq in running:
                ops.append(Append(seq, toks))
                writes[seq] = ("append", toks)
            if fork and running:
                ops.append(Fork(running[0], self.next_id))
                family[running[0]] = family[self.next_id] = {running[0], self.next_id}
                self.next_id += 1
            return ops, writes

        def round2() -> tuple[list, dict]:
            seqs = [x for x in sorted(self.m.seqs) if not self.m.seqs[x].on_cpu]
            if not seqs:
                return [], {}
            # preemption takes whole groups: a sequence and the child forked from it this step
            group = sorted(set().union(*(family.get(x, {x}) for x in {seqs[p % len(seqs)] for p in picks})))
            return ([SwapOut(group)] if swap else [Free(x) for x in group]), {}

        def round3() -> tuple[list, dict]:
            if not readmit:
                return [], {}
            cpu = [x for x in sorted(self.m.seqs) if self.m.seqs[x].on_cpu]
            ops: list = [SwapIn(cpu[-1:])] if cpu else []
            seq = self.next_id
            self.next_id += 1
            prompt = BASES[1][:n]
            ops.append(Allocate(seq, prompt, len(prompt)))
            self.tables[seq] = []
            return ops, {seq: ("alloc", prompt)}

        self.run_rounds([round0, round1, round2, round3])
        for seq in list(self.tokens):
            if seq not in self.m.seqs:
                del self.tokens[seq]
        for seq in list(self.tables):
            if seq not in self.m.seqs:
                del self.tables[seq]

    # ---- invariants ---------------------------------------------------------

    @invariant()
    def tables_read_back_their_tokens(self) -> None:
        if not hasattr(self, "m"):
            return
        assert set(self.m.seqs) == set(self.tokens)
        for seq, toks in self.tokens.items():
            s = self.m.seqs[seq]
            assert s.num_tokens == len(toks)
            if s.on_cpu:
                mem, table = self.cpu_mem, self.m.block_table(seq)
            else:
                mem, table = self.gpu_mem, self.tables[seq]
                assert table == self.m.block_table(seq), "diffs do not rebuild the table"
            got = [mem[table[i // self.bs]][i % self.bs] for i in range(len(toks))]
            assert got == toks, f"seq {seq} reads {got}, wrote {toks}"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq in list(self.tokens):
            self.m.free(seq)
        self.m.begin_step()  # blocks held for this step's copies come back
        self.m.check_integrity()
        st_ = self.m.stats()
        assert st_.num_free_gpu_blocks == st_.num_gpu_blocks, "GPU blocks leaked"
        assert st_.num_free_cpu_blocks == st_.num_cpu_blocks, "CPU blocks leaked"
        assert st_.num_shared_block_refs == 0 and st_.num_seqs == 0
        assert st_.prefix_cache_hits <= st_.prefix_cache_queries


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerProperties = BlockManagerMachine.TestCase
