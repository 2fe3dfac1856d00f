"""`python -m sglang_router.launch_router`, with the replicas' API key and the admin key from the environment.

The router needs the key to register a replica (it reads /server_info, which the key protects), and its only way
to get it is `--api-key`, which would show the key in every process listing. The fleet passes it here in the
same variable the replicas read (sglang_ext/names.py API_KEY).

The router's own control plane (`/workers`: register or remove a worker URL; `/flush_cache`; WASM modules) takes
the API key unless control-plane keys are set, so any client could point it at a worker of their own. The admin
key (names.ADMIN_API_KEY) becomes its one control-plane key, role admin (`--control-plane-api-keys`, not on the
command line either); without one a random key nobody holds closes the control plane (the fleet passes its own
to read /workers).
"""
from __future__ import annotations

import os
import secrets
import sys

from sglang_ext import names


def main() -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(sys.argv[1:])
    key = os.environ.get(names.API_KEY)
    if key:
        args.api_key = key
    admin_key = os.environ.get(names.ADMIN_API_KEY) or secrets.token_urlsafe(32)
    args.control_plane_api_keys = [("admin", "dflash-serve admin", admin_key, "admin")]  # (id, name, key, role)
    launch_router(args)


if __name__ == "__main__":
    main()
