"""`python -m sglang_router.launch_router`, with the replicas' API key from the environment.

The router needs the key to register a replica (it reads /server_info, which the key protects), and its only way
to get it is `--api-key`, which would show the key in every process listing. The fleet passes it here in the
same variable the replicas read (sglang_ext/names.py API_KEY).
"""
from __future__ import annotations

import os
import sys

from sglang_ext import names


def main() -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(sys.argv[1:])
    key = os.environ.get(names.API_KEY)
    if key:
        args.api_key = key
    launch_router(args)


if __name__ == "__main__":
    main()
