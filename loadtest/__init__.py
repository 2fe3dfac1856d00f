"""Load testing for dflash-serve: a Locust chat user (`chat.py`) and a config x concurrency sweep (`sweep.py`).

The helpers (`sse`, `dataset`, `summary`, `server_metrics`, `report`) never import Locust: Locust gevent-patches
the whole process it is imported in, so whatever tests or the sweep import must stay free of it.
"""
