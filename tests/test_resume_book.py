"""The frontend's resume book (issue 11): what it re-sends to a restarted
scheduler for n = 1, n > 1 (one request per unfinished sample, seeded
seed + index, with that sample's streamed tokens) and beam search (the
original, searched again), and how it routes a resumed sample's outputs
back to its request and index."""
from __future__ import annotations

from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import SamplingParams
from pagedserve.frontend.core.resume import ResumeBook


def delta(rid: str, index: int, ids: list[int], reason: str | None = None) -> fe.TokenDelta:
    return fe.TokenDelta(rid, index, ids, reason)


def test_parallel_sampling_resumes_each_unfinished_sample_with_its_own_seed_and_tokens() -> None:
    book = ResumeBook()
    book.sent(fe.AddRequest("a", [1, 2], SamplingParams(max_tokens=9, n=3, seed=40, temperature=0.8), 5.0))
    for d in (delta("a", 0, [7]), delta("a", 2, [8, 9]), delta("a", 1, [4], "length"), delta("a", 0, [6])):
        assert book.route(d) == d
    again = {r.request_id: r for r in book.resumed()}
    assert sorted(again) == ["a/0", "a/2"]  # sample 1 finished: its stream has everything
    a0, a2 = again["a/0"], again["a/2"]
    assert (a0.prompt_token_ids, a0.num_output_tokens, a0.params.seed, a0.params.n) == ([1, 2, 7, 6], 2, 40, 1)
    assert (a2.prompt_token_ids, a2.num_output_tokens, a2.params.seed, a2.params.n) == ([1, 2, 8, 9], 2, 42, 1)
    assert a0.resume and a2.resume and a0.params.max_tokens == 9 and a0.arrival_time == 5.0
    # The new scheduler's outputs for a/2 reach index 2 of a, and count for a later resume.
    assert book.route(delta("a/2", 0, [3])) == delta("a", 2, [3])
    assert {r.request_id: r.prompt_token_ids for r in book.resumed()}["a/2"] == [1, 2, 8, 9, 3]
    assert book.engine_ids("a") == ["a", "a/0", "a/2"]
    book.forget("a")
    assert book.route(delta("a/0", 0, [1])) is None and book.engine_ids("a") == ["a"] and not book.resumed()


def test_unseeded_samples_stay_unseeded_and_single_requests_keep_their_id() -> None:
    book = ResumeBook()
    book.sent(fe.AddRequest("u", [5], SamplingParams(n=2, temperature=1.0), 0.0))
    book.sent(fe.AddRequest("s", [5, 6], SamplingParams(seed=3), 0.0))
    book.route(delta("s", 0, [9, 10]))
    again = {r.request_id: r for r in book.resumed()}
    assert again["u/0"].params.seed is None and again["u/1"].params.seed is None
    assert (again["s"].prompt_token_ids, again["s"].num_output_tokens, again["s"].params.seed) == ([5, 6, 9, 10], 2, 3)


def test_prompt_logprobs_are_not_asked_again_once_the_stream_has_them() -> None:
    book = ResumeBook()
    book.sent(fe.AddRequest("p", [1, 2], SamplingParams(prompt_logprobs=1, n=2, seed=1), 0.0))
    book.sent(fe.AddRequest("q", [1, 2], SamplingParams(prompt_logprobs=1), 0.0))
    book.route(delta("p", 0, [3]))
    again = {r.request_id: r for r in book.resumed()}
    assert again["p/0"].params.prompt_logprobs is None and again["p/1"].params.prompt_logprobs is None
    assert again["q"].params.prompt_logprobs == 1  # nothing came yet


def test_beam_search_is_sent_again_unchanged_and_not_once_its_beams_arrived() -> None:
    book = ResumeBook()
    req = fe.AddRequest("b", [1, 2, 3], SamplingParams(beam_width=3, n=2, temperature=0.0), 0.0)
    book.sent(req)
    (again,) = book.resumed()
    assert again.prompt_token_ids == [1, 2, 3] and again.num_output_tokens == 0 and again.resume
    assert again.params == req.params and again.request_id == "b"
    for i in range(2):
        book.route(fe.TokenDelta("b", i, [4, 5], "length", replace=True))
    assert not book.resumed()
