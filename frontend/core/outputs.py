"""From engine token deltas to what a client sees: incremental text, stop
strings with streaming hold-back, logprobs, finish reasons.

Pure code (no sockets, no gRPC): the gRPC servicer and the HTTP gateway both
feed ``TokenDelta``s in and format the ``Chunk``s that come out.

Hold-back: text that could be the start of a stop string is kept until the
next tokens decide it. Token ids are held with the text they spell (each
token is released once all the text up to its end has been released), so a
client that decodes ids sees no more than one that reads text.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.messages.frontend import TokenDelta
from pagedserve.frontend.core.detokenizer import IncrementalDetokenizer, decode_whole

Logprob = tuple[float, list[tuple[int, float]]]  # (logprob of the token, top-k (token, logprob))

# An output that ends inside a multi-byte character (a length cut): its held
# bytes are dropped, as vLLM 0.32's detokenizer drops them (True would send them
# as U+FFFD, ``tokenizer.decode`` of the ids, as releases before this one did;
# tests/test_detokenizer_stream.py checks both).
INCOMPLETE_END_AS_FFFD = False


class StopChecker:
    """Finds the earliest stop string in streamed text and holds back any
    suffix that might still grow into one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._max_hold = max(len(s) for s in stops) - 1
        self._firsts = {s[0] for s in stops}
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to release, matched stop string or None).
        On a match the released text ends just before the stop string."""
        buf = self._held + text
        best = first_stop(buf, self.stops)
        # The earliest position where a longer stop string may still be completing:
        # a complete match after it is not yet the earliest one.
        pending = next((j for j in range(max(0, len(buf) - self._max_hold), len(buf))
                        if buf[j] in self._firsts
                        and any(len(s) > len(buf) - j and s.startswith(buf[j:]) for s in self.stops)), None)
        if best is not None and (pending is None or best[0] <= pending):
            self._held = ""
            return buf[:best[0]], best[1]
        if pending is None:
            self._held = ""
            return buf, None
        self._held = buf[pending:]
        return buf[:pending], None

    def flush(self) -> tuple[str, str | None]:
        """At the end of the output: the held text, cut at a stop string it holds."""
        held, self._held = self._held, ""
        hit = first_stop(held, self.stops)
        return (held, None) if hit is None else (held[:hit[0]], hit[1])


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


@dataclass
class Chunk:
    """New output of one index since the previous chunk."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[int, Logprob]] = field(default_factory=list)  # (token id, entry)
    finish_reason: str | None = None
    stop_reason: str | None = None
    replace: bool = False
    cumulative_logprob: float | None = None

    def merge(self, later: "Chunk") -> None:
        if later.replace:
            self.token_ids, self.text, self.logprobs = [], "", []
            self.replace = True
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason or self.stop_reason
        if later.cumulative_logprob is not None:
            self.cumulative_logprob = later.cumulative_logprob


def merge_into(merged: dict[int, Chunk], chunk: Chunk) -> None:
    """Fold ``chunk`` into the pending output of its index."""
    if chunk.index in merged:
        merged[chunk.index].merge(chunk)
    else:
        merged[chunk.index] = chunk


class OutputState:
    """One of a request's n outputs. Without a tokenizer (the request's
    ``detokenize`` is false) only token ids are released, with no text."""

    def __init__(self, index: int, tokenizer: Any, prompt_ids: list[int], stops: tuple[str, ...],
                 include_stop: bool, want_logprobs: bool, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, incomplete_end_as_fffd: bool = INCOMPLETE_END_AS_FFFD) -> None:
        self.index = index
        self._fffd_end = incomplete_end_as_fffd
        self._tok = tokenizer
        self._prompt_ids = prompt_ids
        self._detok_kw = {"skip_special_tokens": skip_special_tokens,
                          "spaces_between_special_tokens": spaces_between_special_tokens}
        self._detok = self._detokenizer() if tokenizer is not None else None
        self._stops = stops
        self._stop = StopChecker(stops) if stops else None
        self._include_stop = include_stop
        self._want_logprobs = want_logprobs
        # [token, logprob, end offset of its text]; the offset is None while the
        # detokenizer still holds the token's bytes (an incomplete character).
        self._pending: deque[list[Any]] = deque()
        self._chars = 0  # text decoded so far
        self._released_chars = 0
        self.num_tokens = 0  # tokens released to the client
        self.cumulative_logprob = 0.0
        self.finished = False
        self.stopped_by_string = False

    def _detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, self._prompt_ids, **self._detok_kw)

    def _release(self, chunk: Chunk, upto_chars: int | None) -> None:
        while self._pending and (upto_chars is None or (self._pending[0][2] is not None and
                                                         self._pending[0][2] <= upto_chars)):
            tok, lp, _ = self._pending.popleft()
            chunk.token_ids.append(tok)
            if lp is not None:
                chunk.logprobs.append((tok, lp))
            self.num_tokens += 1

    def on_delta(self, d: TokenDelta) -> Chunk | None:
        if self.finished:
            return None
        if d.replace:
            return self._on_whole(d)
        chunk = Chunk(self.index)
        lps: list[Logprob | None] = list(d.logprobs) if len(d.logprobs) == len(d.token_ids) else \
            [None] * len(d.token_ids)
        final = d.finish_reason is not None
        last = len(d.token_ids) - 1 if final and self._fffd_end else -1
        for i, (tok, lp) in enumerate(zip(d.token_ids, lps)):
            text = "" if self._detok is None else self._detok.add([tok], final=i == last)
            self._chars += len(text)
            self._pending.append([tok, lp if self._want_logprobs else None, None])
            if text:
                for entry in reversed(self._pending):
                    if entry[2] is not None:
                        break
                    entry[2] = self._chars
            if lp is not None:
                self.cumulative_logprob += lp[0]
            if self._stop is None:
                chunk.text += text
                continue
            emit, matched = self._stop.feed(text)
            self._released_chars += len(emit)
            chunk.text += emit
            if matched is not None:
                if self._include_stop:
                    chunk.text += matched
                self._release(chunk, None)  # tokens up to the one that completed the stop string
                chunk.finish_reason, chunk.stop_reason = "stop", matched
                self.finished = self.stopped_by_string = True
                break
            self._release(chunk, self._released_chars)
        if self._stop is None:
            self._release(chunk, None)
        if final and not self.finished:
            matched = None
            if self._stop is not None:
                tail, matched = self._stop.flush()
                chunk.text += tail + (matched if matched is not None and self._include_stop else "")
            self._release(chunk, None)
            chunk.finish_reason = d.finish_reason
            if matched is not None:
                chunk.finish_reason, chunk.stop_reason = "stop", matched
                self.stopped_by_string = True
            self.finished = True
        if self.finished and self._want_logprobs:
            chunk.cumulative_logprob = d.cumulative_logprob if d.cumulative_logprob is not None \
                else self.cumulative_logprob
        if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
            return None
        return chunk

    def _on_whole(self, d: TokenDelta) -> Chunk:
        """A beam (or any output) sent whole: replaces what was sent before."""
        ids = list(d.token_ids)
        lps = list(d.logprobs) if len(d.logprobs) == len(ids) else []
        text = "" if self._tok is None else decode_whole(self._tok, self._prompt_ids, ids, **self._detok_kw)
        chunk = Chunk(self.index, replace=True, finish_reason=d.finish_reason,
                      cumulative_logprob=d.cumulative_logprob)
        hit = first_stop(text, self._stops) if self._stops else None
        if hit is not None:
            end = hit[0] + (len(hit[1]) if self._include_stop else 0)
            # Keep the tokens up to the one whose text completes the stop string.
            detok = self._detokenizer()
            n, chars = 0, 0
            while n < len(ids) and chars < hit[0] + len(hit[1]):
                chars += len(detok.add([ids[n]], final=n == len(ids) - 1))
                n += 1
            ids, lps, text = ids[:n], lps[:n], text[:end]
            chunk.finish_reason, chunk.stop_reason = "stop", hit[1]
        chunk.token_ids, chunk.text = ids, text
        if self._want_logprobs:
            chunk.logprobs = list(zip(ids, lps))
        self.num_tokens = len(ids)
        self.finished = d.finish_reason is not None or hit is not None
        return chunk
