"""The controller stays pure: importing it (and the simulator) pulls in neither torch nor sglang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_import_pulls_in_neither_torch_nor_sglang() -> None:
    code = (
        "import sys, json\n"
        "import sglang_ext.controller as c\n"
        "import harness.simulator, harness.workload, sglang_ext.controller.roofline\n"
        "from sglang_ext.controller import ControllerConfig, BlockSizeController, CostModel\n"
        "ctrl = BlockSizeController(ControllerConfig(), CostModel.default((1, 2, 4, 8, 16)))\n"
        "ctrl.decide(['a'])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang'))))\n"
    )
    # without the CPU layer's start-up hook (DFLASH_SERVE_CPU imports torch at interpreter start), which a test
    # that activated the layer in the pytest process would otherwise hand down
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_SERVE_CPU", "SGLANG_USE_CPU_ENGINE")}
    env |= {"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_controller_sources_do_not_mention_the_heavy_imports() -> None:
    pkg = REPO / "sglang_ext" / "controller"
    for f in pkg.glob("*.py"):
        text = f.read_text()
        for bad in ("import torch", "from torch", "import sglang\n", "from sglang "):
            assert bad not in text, f"{f.name}: {bad!r}"
