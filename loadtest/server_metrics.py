"""Scrape a server's Prometheus /metrics and turn before/after snapshots into per-point numbers."""
from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# sample name -> [(labels, value)]
Snapshot = dict[str, list[tuple[dict[str, str], float]]]

BLOCK_STEPS = "dflash_block_size_steps_total"   # the adaptive worker's counter, labelled by block_size
RAGGED_STEPS = "dflash_ragged_steps_total"   # its steps that verified a width per request (not in BLOCK_STEPS)
ACCEPTED_AT = "dflash_accepted_tokens_by_position_total"  # draft tokens accepted at position j
TRIED_AT = "dflash_tried_tokens_by_position_total"        # draft tokens verified at position j


def parse(text: str) -> Snapshot:
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def scrape(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> Snapshot | None:
    """The server's metrics, or None when it exposes none (404, `server.metrics: false`, not SGLang) or is gone
    (the load test's failures say so; a scrape must not end the sweep)."""
    req = urllib.request.Request(f"{url}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return parse(r.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def scrape_all(urls: list[str], headers: dict[str, str] | None = None, timeout: float = 30) -> Snapshot | None:
    """The metrics of several servers (a fleet's replicas) as one snapshot: every sample of each, so totals are
    the fleet's. None when none of them answers."""
    snaps = [s for s in (scrape(u, headers, timeout) for u in urls) if s is not None]
    if not snaps:
        return None
    out: Snapshot = {}
    for snap in snaps:
        for name, samples in snap.items():
            out.setdefault(name, []).extend(samples)
    return out


def total(snap: Snapshot | None, name: str) -> float | None:
    """Sum of a sample over all its label sets (SGLang labels by rank, streaming, ...); None if absent."""
    if not snap or name not in snap:
        return None
    return sum(v for _, v in snap[name])


def _delta(before: Snapshot | None, after: Snapshot | None, name: str) -> float | None:
    a, b = total(after, name), total(before, name)
    if a is None:
        return None
    return a - (b or 0.0)


def _ratio(num: float | None, den: float | None, scale: float = 1.0) -> float | None:
    return num / den * scale if num is not None and den else None


def point_deltas(before: Snapshot | None, after: Snapshot | None) -> dict:
    """What the server did between two scrapes.

    accept_length: generated tokens per verify step (accepted drafts + the bonus token), from the
    `sglang:generation_tokens_total` and `sglang:spec_verify_calls_total` counters -- the window's mean, unlike
    the `sglang:spec_accept_length` gauge, which is the last logging interval's. block_size_shares: fraction of
    verify steps at each block size (and "ragged": the steps that verified a width per request), only when the
    server exports `dflash_block_size_steps_total`. position_acceptance: per draft position j, the share of the
    tokens verified there that were accepted (`dflash_accepted_tokens_by_position_total` /
    `dflash_tried_tokens_by_position_total`). Snapshots of several replicas (scrape_all) give the fleet's.
    """
    if after is None:
        return {"metrics": False}
    gen = _delta(before, after, "sglang:generation_tokens_total")
    verify = _delta(before, after, "sglang:spec_verify_calls_total")
    out = {
        "metrics": True,
        "generation_tokens": gen,
        "spec_verify_calls": verify,
        "accept_length": _ratio(gen, verify),
        "spec_accept_length_gauge": total(after, "sglang:spec_accept_length"),
        "block_size_shares": block_size_shares(before, after),
        "position_acceptance": position_acceptance(before, after),
    }
    for key, family in (("ttft", "time_to_first_token"), ("itl", "inter_token_latency"),
                        ("e2e", "e2e_request_latency")):
        base = f"sglang:{family}_seconds"
        out[f"{key}_mean_ms"] = _ratio(_delta(before, after, f"{base}_sum"), _delta(before, after, f"{base}_count"),
                                       1e3)
    return out


def _by_label(before: Snapshot | None, after: Snapshot | None, name: str, label: str) -> dict[str, float]:
    """Δ of a counter per value of one label, summed over its other labels (and over replicas)."""
    out: dict[str, float] = {}
    for sign, snap in ((1.0, after), (-1.0, before)):
        for labels, v in (snap or {}).get(name, []):
            out[labels.get(label, "?")] = out.get(labels.get(label, "?"), 0.0) + sign * v
    return out


def position_acceptance(before: Snapshot | None, after: Snapshot | None) -> dict[str, float] | None:
    """Draft position (1-based, as the server labels it) -> accepted / verified over the window."""
    if not after or TRIED_AT not in after:
        return None
    tried = _by_label(before, after, TRIED_AT, "position")
    accepted = _by_label(before, after, ACCEPTED_AT, "position")
    key = lambda j: (not j.isdigit(), int(j) if j.isdigit() else 0, j)  # noqa: E731 -- numeric order
    out = {j: accepted.get(j, 0.0) / tried[j] for j in sorted(tried, key=key) if tried[j] > 0}
    return out or None


def block_size_shares(before: Snapshot | None, after: Snapshot | None) -> dict[str, float] | None:
    if not after or BLOCK_STEPS not in after:
        return None
    steps: dict[str, float] = {}
    for labels, v in after[BLOCK_STEPS]:
        steps[labels.get("block_size", "?")] = steps.get(labels.get("block_size", "?"), 0.0) + v
    for labels, v in (before or {}).get(BLOCK_STEPS, []):
        steps[labels.get("block_size", "?")] = steps.get(labels.get("block_size", "?"), 0.0) - v
    ragged = _delta(before, after, RAGGED_STEPS)
    if ragged:
        steps["ragged"] = ragged
    n = sum(steps.values())
    if n <= 0:
        return None
    key = lambda b: (not b.isdigit(), int(b) if b.isdigit() else 0, b)  # noqa: E731 -- numeric order
    return {b: steps[b] / n for b in sorted(steps, key=key) if steps[b] > 0}


def is_idle(snap: Snapshot | None) -> bool:
    """No request running or queued (requests the load test abandoned still finish on the server)."""
    return not snap or ((total(snap, "sglang:num_running_reqs") or 0) == 0
                        and (total(snap, "sglang:num_queue_reqs") or 0) == 0)
