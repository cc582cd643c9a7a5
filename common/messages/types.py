"""Value types that travel on more than one channel."""
from __future__ import annotations

import enum

import msgspec

from pagedserve.common.request_fields import TABLE as _D


class StructuredSpec(msgspec.Struct, frozen=True, array_like=True):
    """A grammar the output must follow; the frontend validated it, the worker
    compiles it (xgrammar) and masks the logits of every step with it."""

    kind: str  # "json" (schema text) | "json_object" | "regex" | "choice" (JSON list of strings) | "grammar" (EBNF or Lark)
    spec: str = ""
    # JSON kinds: compact output, no whitespace between tokens (vLLM's option; the
    # server's --structured-outputs-config can also set it for every request).
    disable_any_whitespace: bool = False


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Engine-side sampling parameters; the frontend validates them first. Bounds and
    defaults are common/request_fields.py's table (the containers' defaults are empty)."""

    max_tokens: int = _D["max_tokens"].default
    temperature: float = _D["temperature"].default  # 0 means greedy
    top_p: float = _D["top_p"].default
    top_k: int = _D["top_k"].default  # 0: no top-k (the frontend maps -1 and k >= vocab_size to 0)
    min_p: float = _D["min_p"].default
    seed: int | None = _D["seed"].default
    n: int = _D["n"].default
    min_tokens: int = _D["min_tokens"].default
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = _D["ignore_eos"].default
    repetition_penalty: float = _D["repetition_penalty"].default
    presence_penalty: float = _D["presence_penalty"].default
    frequency_penalty: float = _D["frequency_penalty"].default
    logit_bias: dict[int, float] = {}
    logprobs: int | None = _D["logprobs"].default
    prompt_logprobs: int | None = _D["prompt_logprobs"].default
    # Beam search (beam_width > 1) runs inside the engine; n is then the
    # number of finished beams returned.
    beam_width: int = _D["beam_width"].default
    length_penalty: float = _D["length_penalty"].default
    early_stopping: bool = _D["early_stopping"].default
    structured: StructuredSpec | None = None  # structured outputs (never with beam search)
    # vLLM's allowed_token_ids: only these may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words as token sequences: a sequence's last token is banned
    # while the output ends with the rest of it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> "SamplingParams":
        """Sample ``index`` of ``n`` on its own: seeded ``seed + index``, so the
        outputs equal n separate requests seeded seed, seed+1, ... (the one
        rule for the scheduler's samples and the frontend's resumed ones)."""
        return msgspec.structs.replace(self, n=1, seed=None if self.seed is None else self.seed + index)


class ModelInfo(msgspec.Struct, frozen=True, array_like=True):
    """What the worker learned from the checkpoint, passed up to everyone."""

    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str


class RefusalKind(str, enum.Enum):
    """Why a component answered an error instead of a reply."""

    ERROR = "error"  # the request failed
    BAD_FRAME = "bad_frame"  # it did not decode; nothing changed
    WRONG_PEER = "wrong_peer"  # the component serves another scheduler; nothing changed


class ComponentRefusal(msgspec.Struct, array_like=True):
    """The error reply of the blockmgr and the gpuworker (each channel tags its own subclass)."""

    message: str
    kind: RefusalKind = RefusalKind.ERROR
