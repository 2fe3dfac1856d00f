"""`dflash-serve learn`: the drafter learns the traffic it serves (docs/LEARNING.md).

Its own process (never inside a server): read the capture store (`store.py`), regenerate the target's features and
fine-tune a copy of the serving drafter with the bundled pair's recipe (`distill.py`), gate the candidate on
held-out recent traffic and the original mix (`gate.py`), hot-swap it into every server (`swap.py`), keep the
versions for rollback (`versions.py`); `cli.py` runs a round, a loop, a rollback; `metrics.py` its own /metrics.
"""
