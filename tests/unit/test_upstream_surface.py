"""The worker surface the decode steps use (sglang_ext/steps/upstream_surface.py), pinned to the installed SGLang.

Read from the sources with ``ast``, not by ``hasattr``: upstream's DFlashWorkerV2 hands every attribute it lacks to
its target worker (``__getattr__``), so a member that moved would still "exist" and fail only mid-step. A failure
names the member: find it in the new dflash_worker_v2.py, then fix the steps and the Protocol together
(docs/UPGRADING_SGLANG.md)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SURFACE = REPO / "sglang_ext" / "steps" / "upstream_surface.py"
STEPS = REPO / "sglang_ext" / "steps"
WORKER = REPO / "sglang_ext" / "worker.py"


def _speculative_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package without running SGLang's imports
    assert spec is not None and spec.submodule_search_locations, "SGLang is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "srt" / "speculative"


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text(), str(path))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _params(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)][1:]  # without self


def _self_assigned(fn: ast.FunctionDef) -> set[str]:
    """Attributes ``self.X`` assigned (plainly, annotated or in a tuple) anywhere in ``fn``."""
    out: set[str] = set()
    for node in ast.walk(fn):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def _members(cls: ast.ClassDef) -> tuple[set[str], dict[str, list[str]]]:
    """(attributes: class-level and set in __init__, methods and properties -> their parameters)."""
    attrs: set[str] = set()
    methods: dict[str, list[str]] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            methods[node.name] = _params(node)
            if node.name == "__init__":
                attrs |= _self_assigned(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attrs.add(node.target.id)
        elif isinstance(node, ast.Assign):
            attrs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return attrs, methods


def _upstream_members() -> tuple[set[str], dict[str, list[str]]]:
    """DFlashWorkerV2's members and those of its bases defined in sglang/srt/speculative/."""
    found = {}
    for path in sorted(_speculative_dir().glob("*.py")):
        found.update(_classes(path))
    attrs: set[str] = set()
    methods: dict[str, list[str]] = {}
    todo = ["DFlashWorkerV2"]
    assert "DFlashWorkerV2" in found, "DFlashWorkerV2 is gone from sglang/srt/speculative/"
    while todo:
        cls = found[todo.pop()]
        a, m = _members(cls)
        attrs |= a
        for name, params in m.items():
            methods.setdefault(name, params)  # the subclass's own wins, as in the MRO
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in found]
    return attrs, methods


def _protocol(name: str) -> tuple[set[str], dict[str, list[str]]]:
    cls = _classes(SURFACE)[name]
    attrs, methods = _members(cls)
    return attrs, methods


def test_upstream_provides_every_member_the_steps_use():
    attrs, methods = _upstream_members()
    want_attrs, want_methods = _protocol("UpstreamWorker")
    assert want_attrs and want_methods
    missing = sorted(a for a in want_attrs if a not in attrs and a not in methods)
    assert not missing, f"upstream DFlashWorkerV2 no longer sets: {missing}"
    gone = sorted(m for m in want_methods if m not in methods)
    assert not gone, f"upstream DFlashWorkerV2 no longer defines: {gone}"
    for name, params in want_methods.items():
        lost = [p for p in params if p not in methods[name]]
        assert not lost, f"DFlashWorkerV2.{name} no longer takes {lost}"


def test_the_adaptive_worker_sets_its_own_members():
    own, _ = _protocol("StepWorker")
    assert own
    worker = _classes(WORKER)["AdaptiveDFlashWorker"]
    init = next(n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    missing = sorted(own - _self_assigned(init))
    assert not missing, f"AdaptiveDFlashWorker.__init__ does not set {missing}"


def _worker_names(path: Path) -> set[str]:
    """Members read through ``w`` / ``worker`` (a step's ``ctx.worker``) or ``ctx.worker`` itself."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ("w", "worker")) or (
                isinstance(v, ast.Attribute) and v.attr == "worker" and isinstance(v.value, ast.Name)
                and v.value.id == "ctx"):
            out.add(node.attr)
    return out


def test_the_protocol_lists_every_member_the_steps_use():
    up_attrs, up_methods = _protocol("UpstreamWorker")
    own, _ = _protocol("StepWorker")
    listed = up_attrs | set(up_methods) | own
    unlisted = {}
    for path in sorted(STEPS.glob("*.py")):
        if path == SURFACE:
            continue
        names = _worker_names(path) - listed
        if names:
            unlisted[path.name] = sorted(names)
    assert not unlisted, f"add these to sglang_ext/steps/upstream_surface.py: {unlisted}"
