"""The numbers the sweep reports: exact percentiles and steady-state throughput of a closed-loop run."""
from __future__ import annotations

import pytest

from loadtest.sse import StreamTimings
from loadtest.summary import RunRecorder, describe


def timings(tokens: int = 10, ttft: float = 0.1, e2e: float = 1.0) -> StreamTimings:
    return StreamTimings(ttft=ttft, e2e=e2e, output_tokens=tokens, itl=[0.05, 0.07])


def test_describe_is_exact():
    d = describe([float(x) for x in range(1, 101)])
    assert d["count"] == 100 and d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01)
    assert d["min"] == 1 and d["max"] == 100 and d["mean"] == pytest.approx(50.5)
    assert describe([]) == {"count": 0}


def test_samples_are_milliseconds_and_tokens():
    r = RunRecorder(started_at=0.0)
    r.record("u1", 1.0, timings())
    s = r.summary(end=2.0, requests=1, failures=0, users=1)
    m = s["metrics"]
    assert m["ttft"]["p50"] == pytest.approx(100) and m["e2e"]["p50"] == pytest.approx(1000)
    assert m["itl"]["count"] == 2 and m["tpot"]["p50"] == pytest.approx(900 / 9)
    assert m["output_tokens"]["mean"] == 10 and m["output_tokens"]["unit"] == "tokens"
    assert s["failure_ratio"] == 0 and s["users"] == 1


def test_throughput_counts_the_steady_window_only():
    # 2 users, each completes a 100-token request every 2 s from t=2 (user a) and t=3 (user b) on;
    # in steady state that is exactly 100 tokens/s, and the end cuts requests in flight.
    r = RunRecorder(started_at=0.0)
    for t in range(2, 40, 2):
        r.record("a", float(t), timings(100))
        r.record("b", t + 1.0, timings(100))
    out = r.throughput(end=40.0, users=2)
    # from b's first completion (3 s) to a's last (38 s): every token in it belongs to a recorded request
    assert out["window"] == "steady" and out["window_s"] == pytest.approx(35)
    assert out["output_tok_s"] == pytest.approx(100, rel=0.02)
    assert out["req_s"] == pytest.approx(1.0, rel=0.02)
    assert out["completed"] == 38 and out["output_tokens_total"] == 3800


@pytest.mark.parametrize("latency", [4.5, 4.83, 4.94, 5.1, 5.3])
def test_throughput_is_the_true_rate_wherever_the_completion_bursts_fall(latency):
    # 32 users start together and each runs 128-token requests back to back (20-s point): they finish in bursts
    # one latency apart. Counting the requests completed in the window read 0.69-0.99 of the true rate over these
    # latencies (the last burst inside the window or just outside it); the rate is 32 * 128 / latency.
    r = RunRecorder(started_at=0.0)
    for u in range(32):
        t = 0.002 * u  # the users' requests leave a few ms apart
        while t + latency <= 20.0:
            t += latency
            r.record(u, t, timings(128, ttft=0.15, e2e=latency))
    out = r.throughput(end=20.0, users=32)
    assert out["window"] == "steady"
    assert out["output_tok_s"] == pytest.approx(32 * 128 / latency, rel=0.01)
    assert out["req_s"] == pytest.approx(32 / latency, rel=0.01)


def test_short_run_falls_back_to_start_until_last_completion():
    r = RunRecorder(started_at=0.0)
    r.record("a", 2.0, timings(128))
    out = r.throughput(end=5.0, users=1)
    assert out["window"] == "whole run" and out["output_tok_s"] == pytest.approx(64)


def test_a_user_that_never_finished_means_no_steady_state():
    r = RunRecorder(started_at=0.0)
    for t in range(1, 20):
        r.record("a", float(t), timings(10))
    assert r.throughput(end=20.0, users=2)["window"] == "whole run"
    assert r.throughput(end=20.0, users=1)["window"] == "steady"


def test_reset_restarts_the_run():
    r = RunRecorder(started_at=0.0)
    r.record("a", 1.0, timings())
    r.reset(5.0)
    assert r.started_at == 5.0 and r.completions == [] and r.samples["ttft"] == []


# ------------------------------------------------------------------------------------------------ open loop
def test_poisson_arrivals_are_seeded_and_at_the_rate():
    from loadtest.arrivals import Schedule

    a, b = Schedule(), Schedule()
    a.reset(4.0, "poisson", 0)
    b.reset(4.0, "poisson", 0)
    times = [a.at(k) for k in range(4000)]
    assert times == [b.at(k) for k in range(4000)]          # every run: the same arrival times
    assert times[0] == 0 and all(x < y for x, y in zip(times, times[1:]))
    assert 4000 / times[-1] == pytest.approx(4.0, rel=0.05)
    c = Schedule()
    c.reset(4.0, "constant", 0)
    assert [c.at(k) for k in range(3)] == [0, 0.25, 0.5]


def test_claims_are_in_order_late_when_every_slot_was_busy_and_end_at_the_total():
    from loadtest.arrivals import Schedule

    s = Schedule()
    s.reset(2.0, "constant", 3)
    assert s.claim(100.0) == (0, 0.0)        # the clock starts at the first claim
    assert s.claim(100.1) == (1, pytest.approx(0.4))
    assert s.claim(102.0) == (2, pytest.approx(-1.0))   # due at 101: one second late
    assert s.claim(103.0) is None


def test_open_loop_throughput_counts_the_window_of_sends_and_warmup_tokens_in_it():
    # 1 request/s sent at t = 0..19, each 100 tokens over 2 s (first token at +0.5 s): steady state is exactly
    # 1 req/s and 100 tok/s; a warm-up request sent at -1 streams into the window
    r = RunRecorder(started_at=-5.0)
    r.record_unmeasured(1.0, timings(100, ttft=0.5, e2e=2.0))
    for t in range(20):
        r.record("u", t + 2.0, timings(100, ttft=0.5, e2e=2.0))
    s = r.summary(end=30.0, requests=21, failures=0, users=64, rate=1.0, slo_ttft_ms=400)
    assert s["window"] == "steady" and s["window_s"] == pytest.approx(19)
    assert s["req_s"] == pytest.approx(1.0, rel=0.01) and s["output_tok_s"] == pytest.approx(100, rel=0.01)
    assert s["completed"] == 20 and s["metrics"]["ttft"]["count"] == 20     # the warm-up request: tokens only
    # TTFT 500 ms > 400: nothing met the SLO; per-user speed: 99 tokens in 1.5 s
    assert s["slo_met"] == 0 and s["goodput_req_s"] == 0
    assert s["user_tok_s"] == pytest.approx(66, rel=0.01)


def test_goodput_is_the_share_that_met_both_slos():
    r = RunRecorder(started_at=0.0)
    r.record("a", 1.0, timings(11, ttft=0.1, e2e=1.0))     # TPOT 90 ms
    r.record("b", 2.0, timings(11, ttft=0.3, e2e=1.0))     # TTFT 300 ms
    r.record("c", 3.0, timings(11, ttft=0.1, e2e=2.1))     # TPOT 200 ms
    g = r.goodput(3.0, slo_ttft_ms=200, slo_tpot_ms=100)
    assert g["slo_met"] == 1 and g["goodput_req_s"] == pytest.approx(1.0)
    assert r.goodput(3.0, None, None)["goodput_req_s"] == pytest.approx(3.0)   # no SLO: every request counts
