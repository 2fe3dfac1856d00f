"""The flags both soaks take (loadtest/soak.py: one server; loadtest/fleet_soak.py: a fleet through its router):
the load, the faults mixed into it, and the leak checks after it. Each script adds its own around them."""
from __future__ import annotations

import argparse


def add_soak_flags(p: argparse.ArgumentParser, *, idle_timeout: float, idle_help: str) -> None:
    """The shared flags, each with the default both soaks use, but the time a server may take to go idle
    (``idle_timeout``: a fleet's replicas drain behind a router, and a killed one restarts)."""
    load = p.add_argument_group("load")
    load.add_argument("--duration", type=float, default=600, help="seconds of load (default: %(default)s)")
    load.add_argument("--users", type=int, default=50)
    load.add_argument("--disconnect-share", type=float, default=0.15)
    load.add_argument("--bad-share", type=float, default=0.15)
    load.add_argument("--max-tokens", type=int, default=64, help="normal requests draw from [max/4, max]")
    load.add_argument("--think-time", type=float, default=0.0, help="mean pause between a user's requests (s)")
    load.add_argument("--dataset", default=None, help="prompt JSONL (default: the bundled mix)")
    load.add_argument("--oversized-bytes", type=int, default=3 * 1024 * 1024)
    load.add_argument("--request-timeout", type=float, default=300)
    load.add_argument("--seed", type=int, default=0)
    checks = p.add_argument_group("leak checks")
    checks.add_argument("--idle-timeout", type=float, default=idle_timeout, help=idle_help)
    checks.add_argument("--settle", type=float, default=5, help="seconds after idle before the final samples")
    checks.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before the RSS baseline")
    checks.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="allowed RSS growth, fraction of the baseline")
    checks.add_argument("--rss-tolerance-mb", type=float, default=64, help="allowed RSS growth floor, MiB")
    checks.add_argument("--sample-every", type=float, default=5)
