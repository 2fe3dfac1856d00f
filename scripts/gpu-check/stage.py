"""Stage the GPU check's wheels on a machine with network, for a GPU machine without one (run.sh --offline DIR).

    python3 scripts/gpu-check/stage.py --dest DIR [--python-version 3.12] [--platform TAG ...] [--have FREEZE]
    python3 scripts/gpu-check/stage.py --dest DIR --torch-kernels [...]
    python3 scripts/gpu-check/stage.py --verify-installed        # on the GPU machine: every manifest pin installed?

By default DIR gets what `pip install ".[gpu]"` and the test tools would install, resolved by pip for the GPU
machine's Python and platform (`--python-version`, `--platform`: wheels only). `--torch-kernels` stages instead the
pinned list `manifest.txt` without dependencies: what the serving path imports beyond torch and Triton, without
sgl-kernel and FlashInfer, for a machine that keeps its own torch and cannot take those two (run.sh
--torch-kernels). `--have FREEZE` (the GPU machine's `python3 -m pip freeze`) leaves out every wheel that machine
already has at the same version. DIR also gets `stage.json`, which tells run.sh how to install it.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
MANIFEST = KIT / "manifest.txt"
STAGE_FILE = "stage.json"
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
# beyond the project's own requirements: tests/gpu's runner, and the backend that builds dflash-serve from the tree
TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hatchling>=1.24")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    note: str = ""

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_manifest(path: Path = MANIFEST) -> list[Pin]:
    pins = []
    for line in path.read_text().splitlines():
        spec, _, note = line.partition("#")
        spec = spec.strip()
        if spec:
            name, sep, version = spec.partition("==")
            if not sep:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins.append(Pin(name.strip(), version.strip(), note.strip()))
    return pins


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """dflash-serve's dependencies and its `gpu` extra, as pyproject.toml states them, and TOOLS."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["gpu"], *TOOLS]


def read_freeze(path: Path) -> set[tuple[str, str]]:
    """(name, version) of each `name==version` line of a `pip freeze` output."""
    have = set()
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            have.add((canonical(name), version.strip()))
    return have


def wheel_pin(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def download(specs: list[str], dest: Path, python_version: str, platforms: tuple[str, ...], resolve: bool) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "--dest", str(dest)] + ([] if resolve else ["--no-deps"])
    for platform in platforms:
        cmd += ["--platform", platform]
    subprocess.run(cmd + ["--platform", "any"] + specs, check=True)


def stage(dest: Path, python_version: str, platforms: tuple[str, ...], have: set[tuple[str, str]],
          torch_kernels: bool) -> dict:
    if torch_kernels:  # exact pins: what the machine has is never downloaded
        pins = [p for p in read_manifest() if (canonical(p.name), p.version) not in have]
        specs = [p.spec for p in pins]
    else:  # resolved by pip: what the machine has is known only once downloaded
        specs = project_requirements()
    download(specs, dest, python_version, platforms, resolve=not torch_kernels)
    dropped = []
    for whl in sorted(dest.glob("*.whl")):
        if wheel_pin(whl) in have:
            whl.unlink()
            dropped.append(whl.name)
    if torch_kernels:
        missing = sorted({canonical(p.name) for p in pins} - {wheel_pin(w)[0] for w in dest.glob("*.whl")})
        if missing:
            raise RuntimeError(f"pip downloaded no wheel for {missing}: fix their versions in {MANIFEST.name}")
    plan = {"python_version": python_version, "torch_kernels": torch_kernels, "no_deps": torch_kernels,
            "requirements": specs, "left_out_as_installed": dropped,
            "wheels": sorted(w.name for w in dest.glob("*.whl"))}
    (dest / STAGE_FILE).write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def verify_installed(pins: list[Pin] | None = None) -> list[str]:
    """Manifest pins this interpreter does not have at their version (empty: all installed)."""
    from importlib import metadata

    wrong = []
    for pin in read_manifest() if pins is None else pins:
        try:
            have = metadata.version(pin.name)
        except metadata.PackageNotFoundError:
            have = None
        if have != pin.version:
            wrong.append(f"{pin.spec} (installed: {have})")
    return wrong


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, help="the folder to fill (then copied to the GPU machine)")
    ap.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="the GPU machine's Python, e.g. 3.12 (default: this interpreter's)")
    ap.add_argument("--platform", action="append", help=f"a wheel platform tag the GPU machine takes (repeatable; "
                    f"default: manylinux x86_64, {PLATFORMS[0]} and older)")
    ap.add_argument("--have", type=Path, help="the GPU machine's `pip freeze`: leave out what it already has")
    ap.add_argument("--torch-kernels", action="store_true", help="manifest.txt without dependencies, for run.sh "
                    "--torch-kernels (no sgl-kernel, no FlashInfer, the machine's own torch)")
    ap.add_argument("--verify-installed", action="store_true", help="on the GPU machine: list manifest pins not "
                    "installed at their version")
    a = ap.parse_args(argv)
    if a.verify_installed:
        wrong = verify_installed()
        print("\n".join(wrong) or "all manifest pins installed")
        return 1 if wrong else 0
    if a.dest is None:
        ap.error("--dest is required")
    have = read_freeze(a.have) if a.have else set()
    plan = stage(a.dest, a.python_version, tuple(a.platform or PLATFORMS), have, a.torch_kernels)
    size = sum(f.stat().st_size for f in a.dest.glob("*.whl")) / 2**20
    print(f"{len(plan['wheels'])} wheels, {size:.0f} MiB, in {a.dest} ({len(plan['left_out_as_installed'])} left "
          f"out: the GPU machine has them); copy it there and run: bash scripts/gpu-check/run.sh --offline "
          f"{a.dest}{' --torch-kernels' if a.torch_kernels else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
