"""The benchmarks' paired runs (benchmarks/common.py): two loops taking turns, one iteration
each, each timing only its own iterations. W-tiny's ratios rest on this; a wrong pause
accounting or a lost turn would change every figure without any error."""

import os
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Baton, PairedSteps, iteration_times, run_paired  # noqa: E402


class FakeClock:
    """A clock that moves only when a loop "works": the test then knows every interval."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loop(name: str, clock: FakeClock, cost: float, n: int, order: List[str], phases: int = 1):
    def run(steps: List[Any]) -> Dict[str, Any]:
        if isinstance(steps, PairedSteps):
            steps.clock = clock
        for phase in range(phases):
            for _ in range(n):
                clock.now += cost  # this loop's iteration
                order.append(name)
                steps.append((phase, True, clock()))
        return {"steps": steps, "name": name}
    return run


def test_each_loop_times_its_own_iterations_only_and_the_loops_alternate():
    clock, order = FakeClock(), []
    a, b = run_paired(loop("a", clock, 1.0, 8, order), loop("b", clock, 10.0, 8, order))
    assert order == ["a", "b"] * 8
    # the other loop's 10 (or 1) units between two iterations are not in the interval
    assert iteration_times(a["steps"], warmup=0) == [1.0] * 7
    assert iteration_times(b["steps"], warmup=0) == [10.0] * 7
    assert a["name"] == "a" and b["name"] == "b"


def test_a_loop_that_ends_first_leaves_the_other_running_alone():
    clock, order = FakeClock(), []
    a, b = run_paired(loop("a", clock, 1.0, 3, order), loop("b", clock, 2.0, 6, order))
    assert order == ["a", "b", "a", "b", "a", "b", "b", "b", "b"]
    assert iteration_times(b["steps"], warmup=0) == [2.0] * 5
    assert len(a["steps"]) == 3


def test_phases_are_kept_and_the_first_iteration_of_each_has_no_interval():
    clock, order = FakeClock(), []
    a, _ = run_paired(loop("a", clock, 3.0, 4, order, phases=2), loop("b", clock, 5.0, 4, order, phases=2))
    assert [s[0] for s in a["steps"]] == [0] * 4 + [1] * 4
    assert iteration_times(a["steps"], warmup=0) == [3.0] * 6


def test_an_error_in_either_loop_reaches_the_caller_without_a_hang():
    clock, order = FakeClock(), []

    def failing(steps: List[Any]) -> Dict[str, Any]:
        steps.append((0, True, 0.0))
        raise RuntimeError("loop broke")

    for first, second in ((failing, loop("b", clock, 1.0, 5, order)), (loop("a", clock, 1.0, 5, order), failing)):
        done: List[Any] = []
        t = threading.Thread(target=lambda: done.append(pytest.raises(RuntimeError, run_paired, first, second)))
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "run_paired hung after a loop failed"
        assert "loop broke" in str(done[0].value)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_both_loops_run_on_one_cpu_and_every_thread_gets_its_cpus_back():
    before = os.sched_getaffinity(0)
    seen: List[Any] = []
    stop = threading.Event()
    started: List[threading.Thread] = []

    def probe(steps: List[Any]) -> Dict[str, Any]:
        seen.append(os.sched_getaffinity(0))
        # a thread that outlives the loop, as the engine's checkpoint writer does
        started.append(threading.Thread(target=stop.wait, daemon=True))
        started[-1].start()
        steps.append((0, True, 0.0))
        return {"steps": steps}

    try:
        run_paired(probe, probe)
        assert seen == [{min(before)}, {min(before)}]
        assert os.sched_getaffinity(0) == before
        assert [os.sched_getaffinity(t.native_id) for t in started] == [before, before]
    finally:
        stop.set()


def in_thread(fn: Any, timeout: float = 10.0) -> bool:
    """Run ``fn`` in a thread; whether it returned within ``timeout`` seconds."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_the_baton_never_makes_a_side_wait_for_a_finished_one():
    baton = Baton()
    baton.finish(0)  # side 0 ended while it held the turn: the turn passed to side 1
    baton._turn = 0  # as if side 1 had handed it back just before: only "side 0 is done" lets side 1 go
    assert in_thread(lambda: baton.hand_over(1)), "hand_over waited for a side that had finished"
    assert in_thread(lambda: baton.wait_turn(1)), "wait_turn waited for a side that had finished"
    assert baton._turn == 0  # a hand-over to a finished side changes nothing


def test_a_loop_that_fails_before_its_first_iteration_lets_the_other_run_alone():
    clock, order = FakeClock(), []

    def broken(steps: List[Any]) -> Dict[str, Any]:
        raise ValueError("no data")

    for first, second in ((broken, loop("b", clock, 1.0, 4, order)), (loop("a", clock, 1.0, 4, order), broken)):
        done: List[Any] = []
        assert in_thread(lambda: done.append(pytest.raises(ValueError, run_paired, first, second)), timeout=30)
        assert "no data" in str(done[0].value)
    assert order == ["b"] * 4 + ["a"] * 4
