"""vLLM's ``sha256_cbor`` block hashes (vllm/v1/core/kv_cache_utils.py
``hash_block_tokens`` with ``vllm/utils/hashing.py sha256_cbor``): sha256 of
the canonical CBOR of ``(parent hash, token ids, None)``, chained from
``NONE_HASH`` = sha256_cbor(seed), the seed being $PYTHONHASHSEED or vLLM's
"vllm-none-hash". The blockmgr publishes them in its KV events; a router
computes a prompt's with ``prompt_block_hashes`` to find the replica that
holds the longest prefix. No cbor2 needed: the one shape is encoded here."""
from __future__ import annotations

import hashlib
import os
import struct


def external_hash(key: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on (its default)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR item head: the shortest length encoding (RFC 8949, 4.2.1)."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit CBOR")


def sha256_cbor_block(parent: bytes, token_ids: list[int]) -> bytes:
    """vLLM's ``hash_block_tokens(sha256_cbor, parent, tokens, None)``:
    sha256 of ``cbor2.dumps((parent, tuple(tokens), None), canonical=True)``."""
    out = [b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(token_ids))]
    out += [_cbor_head(0, t) for t in token_ids]  # token ids are never negative
    out.append(b"\xf6")
    return hashlib.sha256(b"".join(out)).digest()


def none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: the hash of the seed as a CBOR text string."""
    raw = seed.encode()
    return hashlib.sha256(_cbor_head(3, len(raw)) + raw).digest()


# vLLM's seed rule (kv_cache_utils.resolve_none_hash_seed): PYTHONHASHSEED when set
NONE_HASH = none_hash(os.environ.get("PYTHONHASHSEED") or "vllm-none-hash")


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The published (int) hashes of a prompt's full blocks, in order."""
    out: list[int] = []
    h = NONE_HASH
    for i in range(len(token_ids) // block_size):
        h = sha256_cbor_block(h, token_ids[i * block_size:(i + 1) * block_size])
        out.append(external_hash(h))
    return out
