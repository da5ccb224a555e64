"""The fault suite's judge of duplicated runs (tests/faults/harness.py ``duplicated``): what it
excuses after a SIGKILL, and what it must still count. No processes: the runs log as events."""

from __future__ import annotations

from tests.faults.harness import duplicated

KILLED = frozenset({100})


def test_a_rerunnable_run_that_ended_in_the_killed_process_and_ran_again_elsewhere_is_allowed() -> None:
    seen = [("start", 100), ("end", 100), ("start", 200), ("end", 200)]
    assert not duplicated(seen, once=False, killed=KILLED)


def test_the_same_runs_without_a_kill_are_a_duplicate() -> None:
    seen = [("start", 100), ("end", 100), ("start", 200), ("end", 200)]
    assert duplicated(seen, once=False)


def test_only_one_end_in_the_killed_process_is_excused() -> None:
    seen = [("start", 100), ("end", 100), ("start", 100), ("end", 100), ("start", 200), ("end", 200)]
    assert duplicated(seen, once=False, killed=KILLED)


def test_an_end_in_the_killed_process_is_excused_only_if_a_start_elsewhere_came_after_it() -> None:
    # Ran to its end on 200 first, then again on 100 before the kill: two finished runs, no excuse.
    seen = [("start", 200), ("end", 200), ("start", 100), ("end", 100)]
    assert duplicated(seen, once=False, killed=KILLED)


def test_a_tool_that_may_not_rerun_starts_once_kill_or_not() -> None:
    assert duplicated([("start", 100), ("end", 100), ("start", 200)], once=True, killed=KILLED)
    assert not duplicated([("start", 100), ("end", 100)], once=True, killed=KILLED)
