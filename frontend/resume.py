"""What the frontend needs to resume its requests on a restarted scheduler
(issue 11): each in-flight request as sent, and the tokens already streamed
for it. A resumed request's prompt is the original prompt plus those tokens,
marked as output (``num_output_tokens``), so the new scheduler recomputes
them and streams only what follows: no duplicate, no gap. Seeded sampling
draws the same tokens (the sampler keys on (seed, position)). Parallel
sampling and beam search keep no single token stream: they are not resumed."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagedserve.common.messages import frontend as fe


@dataclass
class _InFlight:
    req: fe.AddRequest
    streamed: list[int] = field(default_factory=list)
    resumable: bool = True


class ResumeBook:
    def __init__(self) -> None:
        self._reqs: dict[str, _InFlight] = {}

    def sent(self, req: fe.AddRequest) -> None:
        p = req.params
        self._reqs[req.request_id] = _InFlight(req, resumable=p.n == 1 and p.beam_width <= 1)

    def on_delta(self, d: fe.TokenDelta) -> None:
        f = self._reqs.get(d.request_id)
        if f is None:
            return
        if d.index != 0 or d.replace:
            f.resumable = False
        else:
            f.streamed += d.token_ids

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._reqs)

    def resumed(self) -> tuple[list[fe.AddRequest], list[str]]:
        """The requests to re-send, and the ids that cannot be resumed."""
        out, lost = [], []
        for rid, f in self._reqs.items():
            if not f.resumable:
                lost.append(rid)
                continue
            r = f.req
            out.append(msgspec.structs.replace(r, prompt_token_ids=[*r.prompt_token_ids, *f.streamed],
                                               num_output_tokens=r.num_output_tokens + len(f.streamed),
                                               resume=True))
        return out, lost
