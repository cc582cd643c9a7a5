"""An output ended by a stop token, as vLLM 0.32's OpenAI server answers it:
the token's text is left out (its detokenizer skips the token that stopped the
request unless ``include_stop_str_in_output``) and, for one of the request's
``stop_token_ids`` (not the tokenizer's EOS, which vLLM checks first),
``stop_reason`` is that token id.

Applied to the HTTP routes' streams (``apply``, from the gateway's
``open_stream``): it rewrites each chunk that ``RequestStream.next`` returns,
so ``collect`` and the streaming routes see the same."""
from __future__ import annotations

from typing import Any

from pagedserve.frontend.core.generation import RequestStream
from pagedserve.frontend.core.outputs import Chunk


def _fix(c: Chunk, stop_ids: frozenset[int], eos: int | None, token_text: Any, keep_text: bool) -> None:
    if c.finish_reason != "stop" or c.stop_reason is not None or not c.token_ids or c.replace:
        return
    tok = c.token_ids[-1]
    if tok != eos and tok not in stop_ids:
        return
    if not keep_text:
        text = token_text(tok)
        if text and c.text.endswith(text):
            c.text = c.text[:-len(text)]
    if tok != eos:
        # Chunk.stop_reason is annotated str (outputs.py); vLLM's is the id itself (JSON number).
        c.stop_reason = tok  # type: ignore[assignment]


def apply(stream: RequestStream, eos_token_id: int | None) -> RequestStream:
    """``stream`` with its ``next`` answering as vLLM for stop tokens."""
    prep = stream.req.prep
    stop_ids = frozenset(prep.params.stop_token_ids)
    eos = None if prep.params.ignore_eos else eos_token_id
    if not stop_ids and eos is None:
        return stream
    inner = stream.next

    def token_text(tok: int) -> str:  # as the output's own detokenizer spelled it
        return stream.svc.detokenize([tok], skip_special_tokens=prep.skip_special_tokens)

    async def next_() -> list[Chunk] | None:
        chunks = await inner()
        for c in chunks or []:
            _fix(c, stop_ids, eos, token_text, prep.include_stop_str_in_output)
        return chunks

    stream.next = next_  # type: ignore[method-assign]  # collect() reads chunks through self.next
    return stream
