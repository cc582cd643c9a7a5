"""A prompt too long in characters to ever fit ``max_model_len`` tokens is
refused before it is tokenized (tokenizing 1 MB takes about a second).

One token covers at most as many characters as its longest vocabulary
entry (byte-level entries spell one byte per character, and a character is
at least one byte), so a text longer than ``max_model_len * that`` has more
than ``max_model_len`` tokens. That holds only when tokenizing never drops
characters or folds a run of them into one token: a tokenizer whose
normalizer, pre-tokenizer or model might (whitespace splitting, fused
unknown tokens, WordPiece) gets no bound, and is only tokenized off the loop.
"""
from __future__ import annotations

import json
from typing import Any

# Normalizers that never delete characters; the NF* forms may compose a few
# characters into one, hence a margin.
_NORMALIZERS = {"Prepend", "Replace", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Sequence"}
_COMPOSING = {"NFC", "NFKC"}
COMPOSE_MARGIN = 4
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence"}


def _safe(node: Any, allowed: set[str], seen: set[str]) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    seen.add(str(kind))
    if kind not in allowed or str(node.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace" and not node.get("content"):
        return False
    subs = node.get("normalizers") or node.get("pretokenizers") or []
    return all(_safe(s, allowed, seen) for s in subs)


def max_chars_per_token(tokenizer: Any) -> int | None:
    """At most this many prompt characters per token, or None (no safe bound)."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a slow or unusual tokenizer: no bound
        return None
    kinds: set[str] = set()
    if not (_safe(spec.get("normalizer"), _NORMALIZERS, kinds)
            and _safe(spec.get("pre_tokenizer"), _PRE_TOKENIZERS, set())):
        return None
    model = spec.get("model") or {}
    if model.get("type") == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
    elif model.get("type") != "Unigram" or model.get("unk_id") is not None:
        return None  # WordPiece/WordLevel unknown words, fused unigram unknowns: unbounded
    longest = max([len(t) for t in vocab] + [len(a.get("content", "")) for a in spec.get("added_tokens", [])])
    return max(1, longest) * (COMPOSE_MARGIN if kinds & _COMPOSING else 1)
