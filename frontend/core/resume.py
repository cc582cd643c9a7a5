"""What the frontend needs to resume its requests on a restarted scheduler
(issue 11): each in-flight request as sent, and the tokens already streamed
for each of its outputs. A resumed request's prompt is the original prompt
plus those tokens, marked as output (``num_output_tokens``), so the new
scheduler recomputes them and streams only what follows: no duplicate, no
gap. Seeded sampling draws the same tokens (the sampler keys on (seed,
position)).

Parallel sampling (n > 1) resumes per sample: sample i of a request seeded
s is exactly the single request seeded s + i (scheduler/core.py,
``_worker_params``), so each unfinished sample is re-sent as its own n = 1
request ``ID/i`` with its own streamed tokens, and its outputs are routed
back to index i of ID. Beam search streams nothing until its final beams,
and it is deterministic (greedy over the top logprobs), so it is re-sent
unchanged and searches again from the prompt: the same beams."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagedserve.common.messages import frontend as fe

SAMPLE_SEP = "/"  # never in a frontend request id (frontend/core/validation.py), so ID/i cannot collide


@dataclass
class _InFlight:
    req: fe.AddRequest
    streamed: dict[int, list[int]] = field(default_factory=dict)  # output index -> tokens streamed
    finished: set[int] = field(default_factory=set)
    sample_ids: list[str] = field(default_factory=list)  # ID/i sent to a new scheduler so far
    answered: bool = False  # a delta came, and with the first one the prompt logprobs

    @property
    def num_outputs(self) -> int:
        return max(1, self.req.params.n)


class ResumeBook:
    def __init__(self) -> None:
        self._reqs: dict[str, _InFlight] = {}
        self._samples: dict[str, tuple[str, int]] = {}  # engine id of a resumed sample -> (request id, index)

    def sent(self, req: fe.AddRequest) -> None:
        self._reqs[req.request_id] = _InFlight(req)

    def route(self, d: fe.TokenDelta) -> fe.TokenDelta | None:
        """Records a delta from the engine and returns it as its stream sees
        it (a resumed sample's delta renamed to its request and index), or
        None for a request no longer here."""
        if d.request_id in self._reqs:
            rid = d.request_id
        elif (sample := self._samples.get(d.request_id)) is not None:
            rid, index = sample
            d = msgspec.structs.replace(d, request_id=rid, index=index)
        else:
            return None
        f = self._reqs[rid]
        f.answered = True
        if not d.replace:  # beam search's final beams are not resumed from (it searches again)
            f.streamed.setdefault(d.index, []).extend(d.token_ids)
        if d.finish_reason is not None:
            f.finished.add(d.index)
        return d

    def engine_ids(self, request_id: str) -> list[str]:
        """Every id the engine may know this request by (to abort it)."""
        f = self._reqs.get(request_id)
        return [request_id, *(f.sample_ids if f is not None else ())]

    def forget(self, request_id: str) -> None:
        f = self._reqs.pop(request_id, None)
        for sid in f.sample_ids if f is not None else ():
            self._samples.pop(sid, None)

    def __len__(self) -> int:
        return len(self._reqs)

    def resumed(self) -> list[fe.AddRequest]:
        """The requests to re-send to a new scheduler (``resume=True``: a copy
        of a request it got already is ignored)."""
        out = []
        for rid, f in self._reqs.items():
            r, p = f.req, f.req.params
            if len(f.finished) >= f.num_outputs:
                continue  # its stream has everything
            if f.answered and p.prompt_logprobs is not None:
                # The stream has them already: not computed again (and the prompt may hit the prefix cache).
                p = msgspec.structs.replace(p, prompt_logprobs=None)
                r = msgspec.structs.replace(r, params=p)
            if p.beam_width > 1:
                out.append(msgspec.structs.replace(r, resume=True))
            elif p.n == 1:
                out.append(self._continued(r, f.streamed.get(0, [])))
            else:
                for i in range(p.n):
                    if i in f.finished:
                        continue
                    sid = f"{rid}{SAMPLE_SEP}{i}"
                    if sid not in self._samples:
                        self._samples[sid] = (rid, i)
                        f.sample_ids.append(sid)
                    one = p.for_sample(i)
                    out.append(self._continued(msgspec.structs.replace(r, request_id=sid, params=one),
                                               f.streamed.get(i, [])))
        return out

    @staticmethod
    def _continued(r: fe.AddRequest, streamed: list[int]) -> fe.AddRequest:
        return msgspec.structs.replace(r, prompt_token_ids=[*r.prompt_token_ids, *streamed],
                                       num_output_tokens=r.num_output_tokens + len(streamed), resume=True)
