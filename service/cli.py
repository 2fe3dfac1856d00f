"""`dflash-serve`: serve, check, build the test model pair, and train the bundled pair."""
from __future__ import annotations

import argparse
import subprocess
import sys

from service.config import ConfigError, load_config


def _serve(a: argparse.Namespace) -> int:
    from service import launcher

    config = load_config(a.config)
    if a.node_rank is not None:
        config = launcher.with_node_rank(config, a.node_rank)
    # The server process checks sglang_args (it imports SGLang anyway); --dry-run checks them here.
    plan = launcher.plan(config, validate_sglang_args=a.dry_run, download=not a.dry_run)
    if a.dry_run:
        print(plan.printable())
        return 0
    return launcher.run(plan, config)


def _fleet(a: argparse.Namespace) -> int:
    from service import fleet

    config = load_config(a.config)
    plan = fleet.plan(config, replicas=a.replicas, port=a.port, download=not a.dry_run)
    if a.dry_run:
        print(plan.printable())
        return 0
    return fleet.run(plan)


def _check(a: argparse.Namespace) -> int:
    from service import launcher

    # check never downloads: a model not there, or not whole, is an error saying what is missing and the fix
    plan = launcher.plan(load_config(a.config), validate_sglang_args=not a.skip_sglang_args, download=False)
    config, r = plan.config, plan.report
    spec = config.speculative
    for note in plan.model_notes:
        print(f"ok: {note}")
    print(f"ok: target {config.model.path} ({r.target_layers} layers, hidden {r.hidden_size}, vocab {r.vocab_size})")
    if spec.algorithm != "none":
        print(f"ok: {spec.algorithm} drafter {spec.draft_model_path} (trained block {r.draft_block_size}, "
              f"verify block {r.block_size}, target layers {list(r.target_layer_ids)})")
    if config.server.device.value == "cuda":
        _print_memory_plan(config, plan, a.gpu_memory_gib)
    return 0


def _print_memory_plan(config, plan, gpu_memory_gib: float | None) -> None:
    from service import memory_plan

    if gpu_memory_gib is not None:
        gpu = int(gpu_memory_gib * memory_plan.GIB), "--gpu-memory-gib"
    else:
        gpu = memory_plan.detect_gpu_bytes()
    if gpu is None:
        print("memory plan: no GPU found here (nvidia-smi); pass --gpu-memory-gib, e.g. 80 for an H100-80GB, "
              "141 for an H200")
        return
    for line in memory_plan.for_config(config, plan.report, gpu_bytes=gpu[0], gpu_source=gpu[1],
                                       env=plan.env).lines():
        print(line)


def _learn(a: argparse.Namespace) -> int:
    from service import learn

    return learn.run(load_config(a.config), a.action, fleet=a.fleet)


# The tiny pair's builder runs as its own process, so the service package never imports dflash_models
# (tests/unit/test_layering.py); its options are its own. Training the bundled pair is dev tooling, not a command:
# python -m dflash_models.build from a checkout.
TRAINING = {"make-test-models": "dflash_models.tiny"}


def _training(argv: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", TRAINING[argv[0]], *argv[1:]])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-serve", description="Serve DFlash speculative decoding on SGLang.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="check the config, then run `sglang serve` with the plugin")
    s.add_argument("--config", "-c", required=True, help="YAML config (see deploy/configs/)")
    s.add_argument("--dry-run", action="store_true", help="print the sglang command and exit")
    s.add_argument("--node-rank", type=int, default=None,
                   help="multi-node tensor parallelism: this node's rank (the config sets sglang_args.nnodes)")
    s.set_defaults(func=_serve)
    f = sub.add_parser("fleet", help="run replicas of the config behind SGLang's router (sglang-router)")
    f.add_argument("--config", "-c", required=True, help="YAML config; its `fleet` section (docs/DEPLOYMENT.md: Fleet)")
    f.add_argument("--replicas", "-n", type=int, default=None, help="number of replicas (default: fleet.replicas)")
    f.add_argument("--port", "-p", type=int, default=None, help="the router's port (default: server.port)")
    f.add_argument("--dry-run", action="store_true", help="print the router and replica plan and exit")
    f.set_defaults(func=_fleet)
    c = sub.add_parser("check", help="run only the preflight checks")
    c.add_argument("--config", "-c", required=True)
    c.add_argument("--skip-sglang-args", action="store_true",
                   help="do not import SGLang to validate sglang_args (fast)")
    c.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                   help="a GPU config: the memory of one GPU for the memory plan (default: read from nvidia-smi)")
    c.set_defaults(func=_check)
    ln = sub.add_parser("learn", help="fine-tune the drafter on captured traffic, gate it, hot-swap it (or roll "
                                      "back): its own process; docs/LEARNING.md")
    ln.add_argument("action", nargs="?", default="round", choices=["round", "loop", "rollback", "status"],
                    help="round (default): one round; loop: a round every learning.interval_seconds; rollback: "
                         "the previous drafter back on every server; status")
    ln.add_argument("--config", "-c", required=True, help="the servers' YAML config (its `learning:` section)")
    ln.add_argument("--fleet", action="store_true", help="swap every replica of the config's fleet")
    ln.set_defaults(func=_learn)
    sub.add_parser("make-test-models", help="create the tiny random test pair (seconds): OUT_DIR",
                   add_help=False)  # listed in --help; main() runs TRAINING[name]
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TRAINING:
        return _training(argv)
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except ConfigError as e:
        print(f"dflash-serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
