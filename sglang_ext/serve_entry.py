"""`python -m sglang_ext.serve_entry serve ...` = `sglang serve ...`, with the API key taken from the environment.

SGLang reads its API key only from `--api-key`, and a command line is world-readable (`ps`,
/proc/PID/cmdline). The launcher therefore passes the key in `DFLASH_SERVE_SGLANG_API_KEY`;
this entry moves it into sys.argv inside the process (the kernel's copy of the command line
is not changed) and removes it from the environment so SGLang's children do not inherit it.
"""
from __future__ import annotations

import os
import sys

from sglang_ext import names as env


def main() -> int:
    key = os.environ.pop(env.API_KEY, None)
    argv = ["sglang", *sys.argv[1:]]
    if key:
        argv += ["--api-key", key]
    sys.argv = argv
    from sglang.cli.main import main as sglang_main

    return sglang_main() or 0


if __name__ == "__main__":
    sys.exit(main())
