"""Issue 22, acceptance 1: the blockmgr's KV events, read by a consumer written
against vLLM's published event classes (tests/vllm_kv_events_ref.py, and the
peer venv's own module where it is installed). Every block stored or removed
shows up, in order, with no gap in the sequence numbers; the hashes are the
same on every replica (recomputed here from the tokens alone)."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
from e2e_util import serve, wait_all_free
from models import make_tiny_model
from vllm_kv_events_ref import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decoder

from pagedserve.common.block_hash import NONE_HASH, external_hash, none_hash, prompt_block_hashes, sha256_cbor_block
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.kv_events_config import KVEventsConfig, parse_kv_events_config

PEERS_PY = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python"


def _decode(mgr: BlockManager) -> list[object]:
    batch = mgr.take_kv_events()
    if batch is None:
        return []
    return list(decoder.decode(msgspec.msgpack.encode(batch)).events)


def _chain(tokens: list[int], bs: int) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent hash, block tokens) of each full block as vLLM's sha256_cbor hashes them."""
    out: list[tuple[int, int | None, list[int]]] = []
    h, parent = NONE_HASH, None
    for i in range(len(tokens) // bs):
        block = tokens[i * bs:(i + 1) * bs]
        h = sha256_cbor_block(h, block)
        out.append((external_hash(h), parent, block))
        parent = external_hash(h)
    return out


def test_block_hashes_are_vllms_sha256_cbor() -> None:
    """Golden values from vLLM 0.32's own functions (peer venv, cbor2 5.x, 2026-12-02):
    sha256(cbor2.dumps(x, canonical=True)) for a block and for the default NONE_HASH seed."""
    assert sha256_cbor_block(b"\x01" * 32, [1, 2, 300, 70000, 5000000000]).hex() == \
        "4ec1c45ac5dfaf2c05295bd2b38dd391dfb5051c85ab30749de7af663f4895eb"
    assert none_hash("vllm-none-hash").hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    if "PYTHONHASHSEED" not in os.environ:
        assert NONE_HASH == none_hash("vllm-none-hash")
    ids = list(range(40))
    assert prompt_block_hashes(ids, 16) == [h for h, _, _ in _chain(ids, 16)]


def test_block_manager_events_with_exact_blocks() -> None:
    """4 usable blocks of 4 tokens: stored on the step after the fill, removed on eviction, cleared on reset."""
    mgr = BlockManager(num_gpu_blocks=5, num_cpu_blocks=0, block_size=4, kv_events=True)
    assert [type(e) for e in _decode(mgr)] == [AllBlocksCleared]
    a = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    mgr.begin_step()
    mgr.allocate(1, a, len(a))
    assert mgr.block_table(1) == [1, 2, 3]
    assert _decode(mgr) == [], "a block is stored only once its step has written it"
    mgr.begin_step()
    (h1, p1, t1), (h2, p2, t2) = _chain(a, 4)
    assert _decode(mgr) == [BlockStored([h1], None, t1, 4, None, "GPU", None),
                            BlockStored([h2], h1, t2, 4, None, "GPU", None)]
    mgr.free(1)  # free queue now 3 4 2 1: unkeyed block 3 first, then the cached ones, chain tail first
    b = list(range(20, 32))
    mgr.allocate(2, b, len(b))
    assert mgr.block_table(2) == [3, 4, 2]
    assert _decode(mgr) == [BlockRemoved([h2], "GPU")], "taking block 2 evicts its key"
    mgr.begin_step()
    assert _decode(mgr) == [BlockStored([h], p, t, 4, None, "GPU", None) for h, p, t in _chain(b, 4)]
    mgr.reset()
    assert [type(e) for e in _decode(mgr)] == [AllBlocksCleared]


def test_prefix_hits_store_nothing_twice() -> None:
    mgr = BlockManager(num_gpu_blocks=9, num_cpu_blocks=0, block_size=4, kv_events=True)
    _decode(mgr)
    prompt = list(range(1, 10))
    mgr.begin_step()
    mgr.allocate(1, prompt, len(prompt))
    mgr.begin_step()
    assert len(_decode(mgr)) == 2
    r = mgr.allocate(2, prompt, len(prompt))
    assert r.num_cached_tokens == 8 and mgr.block_table(2)[:2] == mgr.block_table(1)[:2] == [1, 2]
    mgr.begin_step()
    assert _decode(mgr) == [], "a hit is no new block"


def test_the_flag_takes_vllms_keys() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
                                 ' "replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "topic": "kv"}')
    assert cfg.enabled and cfg.endpoint == "tcp://*:5557" and cfg.buffer_steps == 100
    assert parse_kv_events_config(str(cfg)) == cfg
    assert not KVEventsConfig().enabled and KVEventsConfig().endpoint.startswith("tcp://127.0.0.1:")
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad in ('{"enable": true}', '{"buffer_steps": 0}', '{"endpoint": "http://x"}', "[1]", '{"publisher": "kafka"}'):
        with pytest.raises(Exception, match="."):
            parse_kv_events_config(bad)


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol. A DEALER with the REQ envelope (an empty frame):
    a REQ socket would take only the first of the many replies."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    got: list[tuple[int, bytes]] = []
    while True:
        _, _, seq_bytes, payload = sock.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            break
        got.append((seq, payload))
    sock.close(0)
    return got


@dataclass
class MixedRun:
    bs: int
    prompts: list[list[int]]
    outputs: list[list[int]]
    live: list[tuple[int, bytes]]
    replayed: list[tuple[int, bytes]]
    tmp: Path


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> MixedRun:
    """A real serve under a mixed load (shared prefixes, a small pool: evictions, preemptions),
    its KV events read live on a SUB socket and, at the end, by replay from seq 0."""
    tmp_path = tmp_path_factory.mktemp("kv-events")
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=0)
    pub, rep = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    cfg = f'{{"enable_kv_cache_events": true, "endpoint": "{pub}", "replay_endpoint": "{rep}", "topic": "kv"}}'
    bs = 8
    shared = list(range(100, 124))  # 3 blocks every second prompt shares
    prompts = [(shared if i % 2 else []) + [200 + 7 * i + j for j in range(5 + 6 * i)] for i in range(8)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    live: list[tuple[int, bytes]] = []
    stop = threading.Event()
    # 15 usable blocks of 8 for prompts up to 71 tokens, 4 at a time: evictions and preemptions happen
    with serve("--model", model_dir, "--block-size", str(bs), "--num-gpu-blocks", "16", "--max-num-seqs", "4",
               "--kv-events-config", cfg) as server:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub)

        def listen() -> None:
            while not stop.is_set():
                if sub.poll(50):
                    topic, seq, payload = sub.recv_multipart()
                    live.append((int.from_bytes(seq, "big"), payload))

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        time.sleep(0.5)  # PUB drops what a subscriber not yet joined misses; the replay has it
        outputs: list[list[int]] = [[] for _ in prompts]

        def one(i: int) -> None:
            with server.client() as c:
                outputs[i] = list(c.generate(prompts[i], max_tokens=6 + i, temperature=0.0, ignore_eos=True,
                                             timeout=120)[0])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wait_all_free(server)
        with server.client() as c:  # one more step, so the last fills are committed and published
            c.generate([1, 2, 3], max_tokens=2, temperature=0.0)
        wait_all_free(server)
        time.sleep(0.5)
        stop.set()
        t.join()
        replayed = _replay(ctx, rep, 0)
        sub.close(0)
    ctx.term()
    return MixedRun(bs, prompts, outputs, live, replayed, tmp_path)


def test_a_mixed_run_is_read_in_order_without_gaps(mixed_run: MixedRun) -> None:
    bs, prompts, outputs, live, replayed = (mixed_run.bs, mixed_run.prompts, mixed_run.outputs, mixed_run.live,
                                            mixed_run.replayed)

    seqs = [s for s, _ in replayed]
    assert seqs == list(range(len(seqs))) and len(seqs) > 3, "replay from 0: every batch, no gap"
    by_seq = dict(replayed)
    assert live and all(by_seq[s] == p for s, p in live), "what the subscriber got live is the replayed stream"
    assert [s for s, _ in live] == list(range(live[0][0], live[0][0] + len(live))), "live: in order, no gap"
    batches = [decoder.decode(p) for _, p in replayed]
    assert all(isinstance(b, KVEventBatch) and b.data_parallel_rank == 0 for b in batches)
    events = [e for b in batches for e in b.events]
    assert isinstance(events[0], AllBlocksCleared)
    expected = {h: (p, t) for ids, out in zip(prompts, outputs) for h, p, t in _chain(ids + out[:-1], bs)}
    expected.update({h: (p, t) for h, p, t in _chain([1, 2, 3], bs)})
    cached: set[int] = set()
    stored: set[int] = set()
    for e in events[1:]:
        assert not isinstance(e, AllBlocksCleared)
        (h,) = e.block_hashes
        if isinstance(e, BlockStored):
            assert e.medium == "GPU" and e.block_size == bs and h not in cached, "stored once while cached"
            assert expected[h] == (e.parent_block_hash, e.token_ids), "the hash every replica computes"
            cached.add(h)
            stored.add(h)
        else:
            assert isinstance(e, BlockRemoved) and h in cached, "removed only after stored"
            cached.remove(h)
    assert stored == set(expected), "every full block of every sequence was stored"
    assert any(isinstance(e, BlockRemoved) for e in events), "the small pool evicted"


def test_vllms_own_classes_and_hashes_agree(mixed_run: MixedRun) -> None:
    """vLLM 0.32's own module (the peer venv) decodes the same stream, and its
    hash_block_tokens(sha256_cbor) gives the stored hashes for the same sequences."""
    if not PEERS_PY.exists():
        pytest.skip(f"no peer venv at {PEERS_PY} (scripts/setup-peers.sh): vLLM's own classes not checked")
    bs, prompts, outputs, replayed, tmp_path = (mixed_run.bs, mixed_run.prompts, mixed_run.outputs,
                                                mixed_run.replayed, mixed_run.tmp)
    events = [e for _, p in replayed for e in decoder.decode(p).events]
    stored = {e.block_hashes[0] for e in events if isinstance(e, BlockStored)}
    blob = tmp_path / "payloads.msgpack"
    blob.write_bytes(msgspec.msgpack.encode([p for _, p in replayed]))
    seqs = tmp_path / "seqs.json"
    seqs.write_text(json.dumps([ids + out[:-1] for ids, out in zip(prompts, outputs)] + [[1, 2, 3]]))
    code = ("import sys, json, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
            "from vllm.utils.hashing import sha256_cbor; from vllm.v1.core import kv_cache_utils as k; "
            "k.init_none_hash(sha256_cbor); "
            "d = msgspec.msgpack.Decoder(KVEventBatch); "
            "bs = [d.decode(p) for p in msgspec.msgpack.decode(open(sys.argv[1], 'rb').read())]; "
            "print(sum(type(e).__name__ == 'BlockStored' for b in bs for e in b.events), "
            "sum(type(e).__name__ == 'BlockRemoved' for b in bs for e in b.events)); "
            "hs = set()\n"
            "for t in json.load(open(sys.argv[2])):\n"
            f"    h = None\n    for i in range(len(t) // {bs}):\n"
            f"        h = k.hash_block_tokens(sha256_cbor, h, t[i * {bs}:(i + 1) * {bs}]); "
            "hs.add(k.maybe_convert_block_hash(h))\n"
            "print(json.dumps(sorted(hs)))")
    out = subprocess.run([str(PEERS_PY), "-c", code, str(blob), str(seqs)], capture_output=True, text=True,
                         timeout=300,
                         cwd=tmp_path,  # not the repo root, whose kernels/ folder transformers would import
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    n_stored = sum(isinstance(e, BlockStored) for e in events)
    n_removed = sum(isinstance(e, BlockRemoved) for e in events)
    counts, vllm_hashes = out.stdout.strip().splitlines()[-2:]
    assert counts.split() == [str(n_stored), str(n_removed)]
    assert set(json.loads(vllm_hashes)) == stored, "vLLM hashes the same tokens to the same block hashes"


def test_the_log_forgets_keys_no_pool_caches() -> None:
    """Keys keyed but never cached (a rolled-back step) are dropped once they could outnumber the cached
    ones; a cached key and its parent stay, so its later events still name them."""
    from pagedserve.blockmgr.kv_events import KVEventLog

    log = KVEventLog(4)
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(3000)]
    for i, k in enumerate(keys):
        log.keyed(k, keys[i - 1] if i else b"", [i, i, i, i])
    log.stored(keys[10], "GPU")
    log.forget_uncached()
    log.removed(keys[10], "GPU")  # still known: its hash is the one stored
    stored, removed = log.take_batch().events  # type: ignore[union-attr]
    assert removed.block_hashes == stored.block_hashes and stored.parent_block_hash is not None
    assert set(log._made_of) == {keys[9], keys[10]}
