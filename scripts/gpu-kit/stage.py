"""Stage the GPU kit's wheels HERE (PyPI reachable), in parts small enough to copy one at a time.

    python3 scripts/gpu-kit/stage.py            # download manifest.txt's wheels, slim sglang's, split into parts
    python3 scripts/gpu-kit/stage.py --plan     # only measure the staged parts against what a transfer leaves now
    python3 scripts/gpu-kit/stage.py --verify-installed   # ON the device: is every manifest pin installed?

The wheels land in `.gpukit/` (ignored), one folder per transfer to the GPU machine: `.gpukit/part1`,
`.gpukit/part2`, ... Each part fits beside what every transfer copies anyway (the tracked files, and untracked files
git does not ignore), so a part travels with one copy of the tree; installed parts stay installed while the machine
stays up (scripts/gpu-kit/README.md says how the transfers follow each other). `.gpukit/plan.json` records the sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
STAGE = REPO / ".gpukit"
MANIFEST = KIT / "manifest.txt"
TRANSFER_LIMIT = 64 * 2**20  # a part and the working tree together, at most
MARGIN = 2**20  # files added between staging and the transfer (a report, a note)
PYTHON_VERSION = "3.12"  # the device image's python3 (device-image.txt)
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
# Left out of sglang's wheel (39 MB, the tree's share of a transfer being ~28): the Rust server, benchmark, gRPC and
# multimodal extensions (loaded only by SGLANG_RUST_SERVER, the bench tools, gRPC mode and image processors),
# diffusion serving and SGLang's own tests. Nothing the HTTP server, scheduler or DFlash path imports.
SLIM_SGLANG = (
    "sglang/srt/rust_extensions/_server.", "sglang/srt/rust_extensions/_bench.",
    "sglang/srt/rust_extensions/_grpc.", "sglang/srt/rust_extensions/_multimodal.",
    "sglang/multimodal_gen/", "sglang/test/",
)


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


def repo_share(repo: Path = REPO) -> int:
    """Bytes every transfer copies from this checkout: tracked files, untracked files git does not ignore, and
    shared/."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.split(b"\0")
    paths = {repo / os.fsdecode(p) for p in listed if p}
    if (repo / "shared").is_dir():  # a copy of the checkout carries shared/ whatever git says of it
        paths |= {p for p in (repo / "shared").rglob("*")}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def split(sizes: dict[str, int], room: int) -> list[list[str]]:
    """First-fit decreasing: the fewest parts (transfers) of at most `room` bytes each."""
    parts: list[tuple[int, list[str]]] = []
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        if size > room:
            raise ValueError(f"{name} ({size / 2**20:.1f} MiB) is larger than a transfer's room for wheels "
                             f"({room / 2**20:.1f} MiB): trim it (SLIM_SGLANG) or send less of the repository")
        for i, (used, names) in enumerate(parts):
            if used + size <= room:
                parts[i] = (used + size, names + [name])
                break
        else:
            parts.append((size, [name]))
    return [names for _, names in parts]


def download(pins: list[Pin], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "--dest", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + ["--platform", "any"] + [p.spec for p in pins], check=True)


def slim(wheel: Path, drop: tuple[str, ...] = SLIM_SGLANG) -> Path:
    """Rewrite `wheel` without the members under `drop`, and their RECORD lines; returns the new wheel's path."""
    out = wheel.with_name(wheel.name.replace(".whl", ".slim.whl"))
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.decode().startswith(drop))
            dst.writestr(info, data)
    return out


def _wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def stage(dest: Path = STAGE, pins: list[Pin] | None = None) -> dict:
    pins = read_manifest() if pins is None else pins
    cache = dest / "cache"
    download(pins, cache)
    wanted = {canonical(p.name) for p in pins}
    wheels = {}
    for whl in sorted(cache.glob("*.whl")):
        if whl.name.endswith(".slim.whl") or _wheel_name(whl) not in wanted:
            continue
        wheels[_wheel_name(whl)] = slim(whl) if _wheel_name(whl) == "sglang" else whl
    missing = sorted(wanted - set(wheels))
    if missing:
        raise RuntimeError(f"pip downloaded no wheel for {missing}: fix their versions in {MANIFEST.name}")
    plan = plan_parts({n: w.stat().st_size for n, w in wheels.items()})
    for old in dest.glob("part*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for i, names in enumerate(plan["parts"], 1):
        part = dest / f"part{i}"
        part.mkdir()
        for n in names:
            os.link(wheels[n], part / wheels[n].name.replace(".slim.whl", ".whl"))
    (dest / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    return plan


def plan_parts(sizes: dict[str, int]) -> dict:
    share = repo_share()
    room = TRANSFER_LIMIT - share - MARGIN
    parts = split(sizes, room)
    return {
        "transfer_limit_bytes": TRANSFER_LIMIT, "repository_bytes": share, "margin_bytes": MARGIN, "room_bytes": room,
        "wheels_bytes": sum(sizes.values()), "parts": parts,
        "part_bytes": [sum(sizes[n] for n in names) for names in parts],
        "part_paths": [f".gpukit/part{i}" for i in range(1, len(parts) + 1)],
    }


def staged_plan(dest: Path = STAGE) -> dict:
    """The parts already in `dest`, measured against what a transfer leaves now (the repository grows between runs)."""
    parts = sorted(dest.glob("part*"), key=lambda p: int(p.name[4:]))
    share = repo_share()
    sizes = [sum(w.stat().st_size for w in p.glob("*.whl")) for p in parts]
    return {"transfer_limit_bytes": TRANSFER_LIMIT, "repository_bytes": share, "margin_bytes": MARGIN,
            "room_bytes": TRANSFER_LIMIT - share - MARGIN, "wheels_bytes": sum(sizes),
            "parts": [sorted(_wheel_name(w) for w in p.glob("*.whl")) for p in parts], "part_bytes": sizes,
            "part_paths": [f".gpukit/{p.name}" for p in parts]}


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
    ap.add_argument("--plan", action="store_true", help="measure and split already staged wheels; download nothing")
    ap.add_argument("--verify-installed", action="store_true", help="on the device: list manifest pins not installed")
    a = ap.parse_args(argv)
    if a.verify_installed:
        wrong = verify_installed()
        print("\n".join(wrong) or "all manifest pins installed")
        return 1 if wrong else 0
    plan = staged_plan() if a.plan else stage()
    mib = 2**20
    print(f"repository {plan['repository_bytes'] / mib:.1f} MiB a transfer; "
          f"room for wheels {plan['room_bytes'] / mib:.1f} "
          f"MiB; wheels {plan['wheels_bytes'] / mib:.1f} MiB in {len(plan['parts'])} part(s): "
          + ", ".join(f"{c} {b / mib:.1f} MiB" for c, b in zip(plan["part_paths"], plan["part_bytes"])))
    over = [c for c, b in zip(plan["part_paths"], plan["part_bytes"]) if b > plan["room_bytes"] + plan["margin_bytes"]]
    if over:
        print(f"{over} no longer fit a transfer beside the repository: run stage.py again")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
