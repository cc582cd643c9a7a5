"""The HTTP kill soak's clients (``benchmarks/soak.py``): the request mix, one request
through the ``openai`` client as a user's code sends it, and what it saw.

A client retries only what a client can retry without changing the answer:
- a connection refused (nothing was sent: the frontend is down or restarting),
  after 0.5 s;
- a 503 or 429, after its ``Retry-After`` (1 s when there is none; the refusal
  is recorded either way).
Both until the request's deadline. A request whose connection dropped after it
was sent (a stream cut part way, or a non-streamed answer that never came) is
not retried: its tokens may already have been shown, and the soak counts it."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

PROMPTS = ["Tell me about the sea.", "Write a short poem about autumn.", "What is a prime number?",
           "List three colours.", "Explain what a CPU does.", "Describe a cat in one sentence.",
           "How do trees grow?", "Say hello in French."]
MODEL = "default"  # any name the server serves; the launcher's first served name is used when given
RETRY_CONNECT_S = 0.5
DEADLINE_S = 120.0  # a request that has no answer after this long is a hang (failed)


@dataclass(frozen=True)
class Job:
    key: int
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    seed: int | None  # None: greedy
    prompt: str

    def kind(self) -> str:
        return f"{'chat' if self.chat else 'completion'}-{'stream' if self.stream else 'plain'}-n{self.n}"


def jobs(seed: int = 41, count: int = 24) -> list[Job]:
    """Chat and completions, streamed or not, each greedy with n 1, seeded with n 1 and seeded
    with n 2 (n > 1 needs sampling, as in vLLM): each request's answer is fixed, so each can be
    compared with the undisturbed one."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        chat, stream, mode = bool(k & 1), bool(k & 2), (k // 4) % 3  # mode: greedy, seeded n 1, seeded n 2
        out.append(Job(k, chat, stream, 2 if mode == 2 else 1, rng.randint(8, 32), 1000 + k if mode else None,
                       PROMPTS[rng.randrange(len(PROMPTS))]))
    return out


@dataclass
class Outcome:
    job: int
    kind: str
    t0: float
    t1: float = 0.0
    status: str = ""  # ok | cut | failed (soak.py turns cut into cut_by_frontend_kill or failed)
    why: str = ""
    answer: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (text, finish_reason)
    tokens: int | None = None  # usage.completion_tokens
    refusals: list[dict[str, Any]] = field(default_factory=list)  # every 503/429 seen, and its Retry-After
    refused_connects: list[float] = field(default_factory=list)  # times a connection was refused
    got_first_chunk: bool = False


def _params(job: Job) -> dict[str, Any]:
    p: dict[str, Any] = dict(model=MODEL, n=job.n, max_tokens=job.max_tokens,
                             extra_body={"ignore_eos": True}, timeout=DEADLINE_S)
    if job.seed is None:
        p["temperature"] = 0.0
    else:
        p.update(temperature=0.8, seed=job.seed)
    if job.stream:
        p.update(stream=True, stream_options={"include_usage": True})
    if job.chat:
        p["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        p["prompt"] = job.prompt
    return p


def _text(job: Job, choice: Any) -> str:
    if job.chat:
        return (choice.delta.content if job.stream else choice.message.content) or ""
    return choice.text or ""


def _send(client: Any, job: Job, out: Outcome) -> None:
    api = client.chat.completions if job.chat else client.completions
    if not job.stream:
        r = api.create(**_params(job))
        out.answer = {c.index: (_text(job, c), c.finish_reason or "") for c in r.choices}
        out.tokens = r.usage.completion_tokens if r.usage else None
        return
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in api.create(**_params(job)):
        out.got_first_chunk = True
        for c in chunk.choices:
            texts.setdefault(c.index, []).append(_text(job, c))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            out.tokens = chunk.usage.completion_tokens
    out.answer = {i: ("".join(t), finish.get(i, "")) for i, t in texts.items()}


def run_one(client: Any, job: Job, stop_at: float) -> Outcome:
    """One request to its end, with the retries above; ``stop_at``: no retry starts after it."""
    import openai

    httpx = http_module()

    out = Outcome(job.key, job.kind(), time.monotonic())
    deadline = out.t0 + DEADLINE_S
    while True:
        try:
            _send(client, job, out)
            out.status = "ok"
            break
        except openai.APITimeoutError:
            out.status, out.why = "failed", f"no answer within {DEADLINE_S:.0f} s"
            break
        except openai.APIStatusError as e:
            ra = e.response.headers.get("Retry-After")
            body = _error_body(e)
            if e.status_code not in (429, 503):
                out.status, out.why = "failed", f"HTTP {e.status_code}: {body.get('message', '')!s:.200}"
                break
            out.refusals.append({"t": time.monotonic(), "status": e.status_code, "retry_after": ra,
                                 "code": body.get("code"), "message": str(body.get("message", ""))[:200]})
            wait = float(ra) if ra and ra.isdigit() else 1.0
        except openai.APIConnectionError as e:
            if not isinstance(e.__cause__, httpx.ConnectError):  # sent, then the connection dropped
                out.status, out.why = "cut", f"connection lost before the answer: {e.__cause__!r:.200}"
                break
            out.refused_connects.append(time.monotonic())
            wait = RETRY_CONNECT_S
        except (httpx.TransportError, openai.APIError) as e:  # a stream's body cut, or an error event in it
            cut = isinstance(e, httpx.TransportError)
            out.status = "cut" if cut else "failed"
            out.why = f"stream {'cut' if cut else 'error event'} after {sum(len(t) for t, _ in out.answer.values())}" \
                      f" chars: {e!r:.200}"
            break
        if time.monotonic() + wait > min(deadline, stop_at):
            out.status, out.why = "failed", f"still refused at the deadline ({len(out.refusals)} refusals, " \
                                            f"{len(out.refused_connects)} refused connections)"
            break
        time.sleep(wait)
    out.t1 = time.monotonic()
    return out


def http_module() -> Any:
    """The HTTP library the ``openai`` client raises from (``httpx2`` from openai 3 on, else ``httpx``)."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _error_body(e: Any) -> dict[str, Any]:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body) if isinstance(body.get("error", body), dict) else {}


def check_answer(job: Job, out: Outcome, reference: dict[int, tuple[str, str]] | None) -> str | None:
    """Why a finished answer is wrong, or None: n choices, each finished by its length
    (ignore_eos), usage counting every token, and the undisturbed answer's text."""
    if sorted(out.answer) != list(range(job.n)):
        return f"choices {sorted(out.answer)}, expected {job.n}"
    if any(f != "length" for _, f in out.answer.values()):
        return f"finish reasons {[f for _, f in out.answer.values()]}"
    if any(not t for t, _ in out.answer.values()):
        return "an empty choice"
    if out.tokens != job.n * job.max_tokens:
        return f"usage.completion_tokens {out.tokens}, expected {job.n * job.max_tokens}"
    if reference is not None and out.answer != reference:
        return "text differs from the undisturbed answer"
    return None
