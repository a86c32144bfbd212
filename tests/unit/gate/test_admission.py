"""Admission by KV need (tunerd.gate.admission): pure, driven by ``now``.

The pool in most tests is the seed's RTX 4090 at its working settings, rounded: 4,096 blocks
of 16 tokens (65,536 tokens), ``max_model_len`` 32,768 — four 28K conversations do not fit in
it at once, which is the seed's story.
"""

from __future__ import annotations

import itertools

import pytest

from tunerd.gate.admission import Admission, Limits, Pool, Ticket, need_tokens

POOL = Pool(num_blocks=4096, block_size=16, max_model_len=32768)
_ids = itertools.count(1)


def ticket(prompt: int, max_tokens: int | None = 256, *, at: float = 0.0, priority: int = 0) -> Ticket:
    return Ticket(id=next(_ids), prompt_tokens=prompt, max_tokens=max_tokens, arrival=at, priority=priority)


def gate(**limits: object) -> Admission:
    return Admission(limits=Limits(**limits), pool=POOL)  # type: ignore[arg-type]


def test_need_is_prompt_plus_output_in_whole_blocks_and_a_missing_max_tokens_takes_the_rest() -> None:
    assert need_tokens(100, 28, POOL) == 128
    assert need_tokens(100, 29, POOL) == 144  # one token over: one more block
    assert need_tokens(1000, None, POOL) == 32768  # vLLM lets it run to max_model_len
    assert need_tokens(32000, 4096, POOL) == 32768  # max_tokens is capped by the context


def test_the_seeds_four_long_conversations_run_one_at_a_time_while_short_ones_flow() -> None:
    admission = gate()
    longs = [ticket(28_000, 1024, at=i * 0.1) for i in range(4)]
    verdicts = [admission.offer(t, 1.0) for t in longs]
    assert [v.outcome for v in verdicts] == ["admitted", "queued", "queued", "queued"]
    assert verdicts[1].reason == "long_lane"
    shorts = [ticket(500, 256, at=2.0) for _ in range(8)]
    assert all(admission.offer(t, 2.0).outcome == "admitted" for t in shorts)  # beside the long one
    assert admission.in_flight_tokens <= admission.budget  # type: ignore[operator]
    admitted = admission.done(longs[0], 30.0)
    assert admitted == [longs[1]]  # the next long one, in arrival order
    assert admission.long_running == 1


def test_a_request_over_the_budget_but_within_the_pool_runs_alone() -> None:
    admission = gate(target_fraction=0.4, long_lane=4)  # a budget of 26,214 tokens
    huge = ticket(31_000, 1700)  # 32,704 tokens: over the budget, within the pool
    small = ticket(100, 100)
    assert admission.offer(small, 0.0).outcome == "admitted"
    assert admission.offer(huge, 0.0).reason == "kv_budget"
    assert admission.done(small, 1.0) == [huge]  # nothing else in flight: it runs alone
    assert admission.offer(ticket(100, 100), 1.0).reason == "kv_budget"  # and alone it stays


def test_the_first_waiting_request_holds_a_reservation_shorter_ones_do_not_starve_it() -> None:
    admission = gate(long_lane=4)
    first = ticket(20_000, 1000)
    assert admission.offer(first, 0.0).outcome == "admitted"  # 20,992 of a 58,982 budget
    second = ticket(20_000, 1000)
    assert admission.offer(second, 0.0).outcome == "admitted"  # 41,984
    waiting = ticket(20_000, 1000)
    assert admission.offer(waiting, 0.0).outcome == "queued"  # 62,976 > 58,982
    # 16,998 tokens are free, but the waiting one holds them: a short that would eat into
    # them must wait behind it...
    blocked = ticket(10_000, 0)
    assert admission.offer(blocked, 0.1).outcome == "queued"
    assert admission.queue == [waiting, blocked]
    # ...and one that fits beside it does not (backfilling that does not delay the head)
    assert admission.done(first, 5.0) == [waiting, blocked]


def test_priority_goes_first_and_arrival_breaks_ties() -> None:
    admission = gate(max_concurrency=1)
    running = ticket(100)
    admission.offer(running, 0.0)
    low, normal, high = ticket(100, at=1.0, priority=-1), ticket(100, at=2.0), ticket(100, at=3.0, priority=5)
    for t in (low, normal, high):
        assert admission.offer(t, t.arrival).reason == "max_concurrency"
    assert admission.queue == [high, normal, low]
    assert admission.done(running, 4.0) == [high]


def test_too_large_is_400_at_once_whole_pool_or_context() -> None:
    admission = gate()
    over_context = admission.offer(ticket(32_000, 1000), 0.0)
    assert (over_context.status, over_context.reason) == (400, "too_large")
    assert "maximum context length is 32768 tokens" in over_context.message
    small_pool = Admission(pool=Pool(num_blocks=1000, block_size=16, max_model_len=32768))
    over_pool = small_pool.offer(ticket(20_000, 1000), 0.0)
    assert over_pool.status == 400
    assert "more than the engine's whole pool of 16,000" in over_pool.message
    assert admission.counts[("rejected", "too_large")] == 1


def test_a_full_queue_is_429_with_retry_after_from_the_drain_rate() -> None:
    admission = gate(max_concurrency=1, queue_requests=2)
    first = ticket(1000, 1000)
    admission.offer(first, 0.0)
    assert admission.offer(ticket(1000, 1000), 0.0).outcome == "queued"
    assert admission.offer(ticket(1000, 1000), 0.0).outcome == "queued"
    full = admission.offer(ticket(1000, 1000), 0.0)
    assert (full.status, full.reason, full.retry_after) == (429, "queue_full", 5)  # nothing drained yet
    admission.done(first, 10.0)  # 2,000 tokens done in the 10 s since the first arrived
    # 200 tokens/s; one request of 2,000 still queued, the newcomer's 2,000: 20 s
    assert admission.retry_after(10.0, 2000) == 20
    tokens_full = gate(max_concurrency=1, queue_tokens=3000)
    tokens_full.offer(ticket(1000, 1000), 0.0)
    tokens_full.offer(ticket(1000, 1000), 0.0)
    assert tokens_full.offer(ticket(1000, 1000), 0.0).reason == "queue_tokens"


def test_waiting_past_max_wait_is_503_and_the_queue_moves_on() -> None:
    admission = gate(max_concurrency=1, max_wait=30.0)
    admission.offer(ticket(100), 0.0)
    late = ticket(100, at=1.0)
    admission.offer(late, 1.0)
    assert admission.expire(30.9) == []
    ((who, verdict),) = admission.expire(31.0)
    assert who is late
    assert verdict.status == 503
    assert verdict.reason == "max_wait"
    assert verdict.retry_after is not None
    assert verdict.retry_after >= 1
    assert admission.queue == []


def test_a_hold_admits_nothing_its_time_is_not_counted_against_max_wait_and_release_lets_them_run() -> None:
    admission = gate(max_wait=30.0, hold_max=600.0)
    until = admission.hold(10.0, 120.0)
    assert until == 130.0
    waiting = ticket(100, at=20.0)
    verdict = admission.offer(waiting, 20.0)
    assert (verdict.outcome, verdict.reason) == ("queued", "held")
    assert admission.retry_after(20.0) == 110  # the hold's end
    assert admission.expire(100.0) == []  # 80 s waited, all of it held
    assert admission.release(100.0) == [waiting]
    late = ticket(100, at=100.0)
    admission.retune(100.0, max_concurrency=1)
    admission.offer(late, 100.0)
    assert admission.expire(129.9) == []
    assert len(admission.expire(130.0)) == 1


def test_a_hold_past_its_max_ends_with_503_for_those_who_waited() -> None:
    admission = gate(hold_max=60.0)
    assert admission.hold(0.0, None) == 60.0  # no length given: the max
    assert admission.hold(30.0, 600.0) == 60.0  # extended, never past max from the first start
    waiting = ticket(100, at=5.0)
    admission.offer(waiting, 5.0)
    ((who, verdict),) = admission.expire(60.0)
    assert who is waiting
    assert (verdict.status, verdict.reason) == (503, "hold_expired")
    assert "engine's restart" in verdict.message
    assert not admission.held(60.0)
    assert admission.offer(ticket(100, at=61.0), 61.0).outcome == "admitted"


def test_without_a_known_pool_requests_wait_and_are_sized_when_it_is_known() -> None:
    admission = Admission()
    waiting = ticket(40_000, 100)
    small = ticket(100, 100)
    assert admission.offer(waiting, 0.0).reason == "engine_unknown"
    assert admission.offer(small, 0.0).reason == "engine_unknown"
    ((refused, verdict),) = admission.set_pool(POOL, 1.0)
    assert refused is waiting
    assert verdict.status == 400
    assert admission.pump(1.0) == [small]


def test_live_retune_relanes_waiting_requests_and_rejects_bad_limits() -> None:
    admission = gate(long_threshold=16384)
    running = ticket(9000, 1000)
    assert admission.offer(running, 0.0).reason == "short"
    admission.retune(0.0, long_threshold=8192)
    assert running.long
    second = ticket(9000, 1000)
    assert admission.offer(second, 0.0).reason == "long_lane"
    assert admission.retune(1.0, long_lane=2) == [second]
    with pytest.raises(ValueError, match="target_fraction"):
        admission.retune(1.0, target_fraction=1.5)
    assert admission.limits.long_lane == 2  # a bad retune changes nothing


def test_an_exact_count_shrinks_a_bound_and_lets_the_queue_run() -> None:
    admission = gate(long_lane=1)
    bound = Ticket(id=next(_ids), prompt_tokens=20_000, max_tokens=100, arrival=0.0, exact=False)
    assert admission.offer(bound, 0.0).reason == "long"  # a long bound: in the lane
    other = ticket(17_000, 100)
    assert admission.offer(other, 0.0).reason == "long_lane"
    assert admission.count_exact(bound, 300, 0.01) == [other]  # it was short after all
    assert bound.need == 400


def test_a_request_the_engine_could_not_take_goes_back_to_the_head() -> None:
    admission = gate(max_concurrency=1)
    first, second = ticket(100, at=0.0), ticket(100, at=1.0)
    admission.offer(first, 0.0)
    admission.offer(second, 1.0)
    admission.requeue(first, 2.0)
    assert admission.queue == [first, second]
    assert admission.running == {}


def test_an_offer_that_lets_waiting_requests_run_announces_them() -> None:
    """A hold that ran out between two ticks: the next offer's pump admits the requests that
    waited for it, and says so (their waiters must be woken, or they wait on while counted
    as running)."""
    admission = gate()
    admission.hold(0.0, 60.0)
    waited = ticket(100, at=1.0)
    assert admission.offer(waited, 1.0).reason == "held"
    newcomer = ticket(100, at=60.01)
    assert admission.offer(newcomer, 60.01).outcome == "admitted"  # expire() has not run yet
    assert admission.announce() == [waited]
    assert admission.announce() == []  # once


def test_a_hold_whose_own_length_runs_out_lets_them_run_only_its_max_answers_503() -> None:
    admission = gate(hold_max=600.0, max_wait=30.0)
    admission.hold(0.0, 10.0)  # tunerd asked for 10 s and never released
    waiting = ticket(100, at=1.0)
    admission.offer(waiting, 1.0)
    assert admission.expire(10.0) == []  # not turned away: the hold just ends
    assert not admission.held(10.0)
    assert admission.pump(10.0) == [waiting]
