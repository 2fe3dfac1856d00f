"""`python -m service.server_entry serve ...` = `sglang serve ...`: the server process `dflash-serve serve` starts.

Two things happen here, before SGLang's own CLI runs, because this process imports SGLang anyway:

- The config's `sglang_args` are checked against SGLang's real `serve` parser (service/sglang_args.py), arriving
  as JSON in `DFLASH_SERVE_SGLANG_ARGS`. Checking them in the launcher cost a second `import sglang` on every
  start (benchmarks/startup_time.py, docs/BENCHMARKS.md); a bad one still fails with the same
  `dflash-serve: error: sglang_args.<key>: ...` and exit status 2, before anything is loaded.
- SGLang reads its API key only from `--api-key`, and a command line is world-readable (`ps`,
  /proc/PID/cmdline). The launcher therefore passes the key in `DFLASH_SERVE_SGLANG_API_KEY`; it is moved into
  sys.argv inside the process (the kernel's copy of the command line is not changed) and removed from the
  environment so SGLang's children do not inherit it. The admin key (`DFLASH_SERVE_SGLANG_ADMIN_API_KEY`) travels
  the same way to `--admin-api-key`. Without one a random key goes there: SGLang lets the API key (or, without
  one, anybody) use its admin routes when no admin key is set (`utils/auth.py`, `AuthLevel.ADMIN_OPTIONAL`), and
  with a key nobody holds they are closed to every client while SGLang's own post-warm-up `/freeze_gc` still works.
"""
from __future__ import annotations

import json
import os
import secrets
import sys

from service.config import ConfigError
from sglang_ext import names as env


def main() -> int:
    passthrough = os.environ.pop(env.SGLANG_ARGS, None)
    if passthrough:
        from service.sglang_args import validate_passthrough

        try:
            validate_passthrough(json.loads(passthrough))
        except ConfigError as e:
            print(f"dflash-serve: error: {e}", file=sys.stderr)
            return 2
    key = os.environ.pop(env.API_KEY, None)
    admin_key = os.environ.pop(env.ADMIN_API_KEY, None)
    argv = ["sglang", *sys.argv[1:]]
    # `--flag=value`, not two words: a key may start with "-" (token_urlsafe does one time in 64), which argparse
    # would read as the next option and stop the server with "expected one argument".
    if key:
        argv.append(f"--api-key={key}")
    if admin_key or "--grpc-port" not in argv:  # SGLang refuses any key with its gRPC listener, which has no auth
        argv.append(f"--admin-api-key={admin_key or secrets.token_urlsafe(32)}")
    sys.argv = argv
    from sglang.cli.main import main as sglang_main

    return sglang_main() or 0


if __name__ == "__main__":
    sys.exit(main())
