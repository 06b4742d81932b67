"""tools/elastic_sched.py: static and elastic allocation replayed on a profile, checked on
traces whose job completion times are worked out by hand. No TensorFlow."""
import pytest

from tool_module import load_tool


@pytest.fixture(scope="module")
def sched():
    return load_tool("elastic_sched")


PROFILE = {"a": {1: 1.0, 2: 0.5}}  # twice as fast on 2 ranks


def jct(sched, jobs, policy, stall=1.0):
    return [round(x, 9) for x in sched.simulate(jobs, PROFILE, 2, policy, stall).jct]


def test_a_job_alone_takes_every_slot_and_shrinks_when_another_arrives(sched):
    jobs = [sched.Job(0, "a", 0.0, 20, 1), sched.Job(1, "a", 5.0, 10, 1)]
    assert jct(sched, jobs, "static") == [20.0, 10.0]
    # A runs 10 steps on 2 ranks by t=5; shrinks (1 s stall) and B starts on the other slot;
    # B ends at 15; A (19 steps done) grows back (1 s stall) and runs its last step in 0.5 s
    assert jct(sched, jobs, "elastic") == [16.5, 10.0]
    assert jct(sched, jobs, "elastic", stall=0.0) == [15.0, 10.0]


def test_static_waits_for_the_ranks_it_asked_for(sched):
    jobs = [sched.Job(0, "a", 0.0, 10, 2), sched.Job(1, "a", 1.0, 10, 1)]
    assert jct(sched, jobs, "static") == [5.0, 14.0]  # B waits until A frees both slots at t=5
    # elastic: A has run 2 steps on 2 ranks when B arrives at t=1; each runs on 1 slot; A ends at
    # 9, B (8 steps done) grows to 2 slots for its last 2 steps and ends at 10
    assert jct(sched, jobs, "elastic", stall=0.0) == [9.0, 9.0]


def test_a_trace_replays_the_same_and_refuses_a_profile_without_the_ranks(sched):
    jobs = sched.trace(["a"], 12, 4.0, [5, 10, 20], [1, 2], seed=3)
    first = sched.simulate(jobs, PROFILE, 2, "elastic").summary()
    assert sched.simulate(jobs, PROFILE, 2, "elastic").summary() == first
    assert all(j.done_steps == 0 for j in jobs)  # the trace itself is not consumed
    with pytest.raises(ValueError, match="asks for 4 ranks"):
        sched.simulate([sched.Job(0, "a", 0.0, 5, 4)], PROFILE, 4, "static")
