"""The fleet soak's verdict on each request (loadtest/fleet_soak.py): a failure is forgiven only when the request was
in flight at a kill, and only as many as the killed replica held; a request sent after a kill, or never answered,
counts against the fleet."""
from __future__ import annotations

from loadtest.fleet_soak import Kill, Outcome, Run, classify, counted


def outcome(kind: str, start: float, end: float | None, result: str = "failed") -> Outcome:
    return Outcome(kind, start, end, result=result)


def test_failures_in_flight_at_a_kill_are_forgiven_up_to_what_the_victim_held():
    run = Run(outcomes=[outcome("normal", 1.0, 12.0), outcome("normal", 2.0, 11.0), outcome("disconnect", 3.0, 10.5),
                        outcome("normal", 4.0, 20.0, "ok")],
              kills=[Kill(replica=0, t=10.0, in_flight=2)])
    classify(run)
    assert [o.klass for o in run.outcomes] == ["killed-in-flight", "killed-in-flight", "unexpected", "ok"]
    assert run.kills[0].killed_in_flight == 2


def test_a_request_sent_after_the_kill_or_a_bad_body_that_fails_is_unexpected():
    run = Run(outcomes=[outcome("normal", 10.5, 11.0), outcome("bad", 9.0, 10.5)],
              kills=[Kill(replica=0, t=10.0, in_flight=5)])
    classify(run)
    assert [o.klass for o in run.outcomes] == ["unexpected", "unexpected"]


def test_a_request_never_answered_is_lost_even_across_a_kill():
    run = Run(outcomes=[outcome("normal", 1.0, None, "lost")], kills=[Kill(replica=0, t=10.0, in_flight=5)])
    classify(run)
    assert run.outcomes[0].klass == "lost"


def test_retractions_are_summed_across_a_replica_restart():
    run = Run(timeline=[{"retracted-0": 0.0}, {"retracted-0": 5.0}, {"retracted-0": None}, {"retracted-0": 2.0},
                        {"retracted-0": 4.0}])
    assert counted(run, 0) == 5 + 2 + 2
