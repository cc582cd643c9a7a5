"""Beam search bookkeeping, step for step the algorithm of transformers'
``generate(num_beams=k, do_sample=False)`` (candidate selection, length
penalty, early stopping and its heuristics), so the top beam matches it.

It is pure: each step it takes every running beam's top continuations
(token, logprob) and returns which parent each new beam extends with which
token. The scheduler turns that into blockmgr forks (shared blocks,
copy-on-write on the last one) and frees.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    score: float  # length-penalised for finished hypotheses, cumulative logprob for running ones


@dataclass
class BeamChoice:
    parent: int  # index into the running beams this step
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearch:
    beam_width: int
    prompt_len: int
    max_length: int  # prompt + max new tokens
    eos_token_ids: tuple[int, ...]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    improvable: bool = True
    done: bool = False

    @property
    def candidates_per_beam(self) -> int:
        """Continuations to keep per step (and so logprobs each beam must report)."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    def step(self, running: list[Hypothesis], top: list[list[tuple[int, float]]]) -> list[BeamChoice]:
        """``running``: the live beams (cumulative logprob scores, best first);
        ``top[b]``: beam b's best (token, logprob) continuations. Returns the
        next running beams (empty once the search is done)."""
        k = self.beam_width
        cur_len = self.prompt_len + len(running[0].token_ids)
        cands = sorted(((h.score + lp, b, t) for b, h in enumerate(running) for t, lp in top[b]),
                       key=lambda c: -c[0])[:self.candidates_per_beam]
        at_max = cur_len + 1 >= self.max_length
        hits = [at_max or t in self.eos_token_ids for _, _, t in cands]
        # Finished hypotheses: only from the top-k candidates, and only while they can still matter.
        full = len(self.finished) == k
        if self.improvable and not (full and self.early_stopping is True):
            penal = (cur_len + 1 - self.prompt_len) ** self.length_penalty
            for i, (score, b, t) in enumerate(cands[:k]):
                if hits[i]:
                    self.finished.append(Hypothesis(running[b].token_ids + [t], score / penal))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[k:]
        choices = [BeamChoice(b, t, s) for (s, b, t), hit in zip(cands, hits) if not hit][:k]
        # The heuristic that decides whether a running beam can still beat the worst finished one.
        cur_len += 1
        if choices:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_length - self.prompt_len
            else:
                best_len = cur_len - self.prompt_len
            best_possible = choices[0].cum_logprob / best_len ** self.length_penalty
            if len(self.finished) == k and best_possible <= self.finished[-1].score:
                self.improvable = False
        all_finished = len(self.finished) == k and self.early_stopping is True
        if not choices or not self.improvable or all_finished or all(hits):
            self.done = True
            return []
        return choices

    def results(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
