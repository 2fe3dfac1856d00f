"""A deployment test whose tool is missing skips on a developer's machine and fails in CI (tests/deploy/conftest.py
`tool`): CI's installer puts every tool there, so a silent skip there would hide a broken install -- most of
test_k8s.py skipped on a machine without kubectl. An old kubectl (no kustomize v5) counts as missing."""
from __future__ import annotations

import pytest

from tests.deploy.conftest import tool


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """A PATH holding only a kubectl that says it is 1.20 (Debian's kubernetes-client)."""
    old = tmp_path / "kubectl"
    old.write_text("#!/bin/sh\necho 'Client Version: v1.20.2'\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("DFLASH_DEPLOY_TOOLS_REQUIRED", raising=False)
    return tmp_path


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)],
                         ids=["ci-fails", "developer-skips"])
def test_a_missing_tool_fails_in_ci_and_skips_elsewhere(bare_path, monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    assert outcome_of(lambda: tool("promtool")) is outcome
    assert outcome_of(lambda: tool("kubectl", min_version=(1, 27))) is outcome


def outcome_of(call) -> type | None:
    """The pytest outcome `call` raised (caught here: a skip must not skip this test), None if none."""
    try:
        call()
    except (pytest.fail.Exception, pytest.skip.Exception) as e:
        return type(e)
    return None


def test_a_new_enough_tool_is_found(bare_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert tool("kubectl", min_version=(1, 20)) == str(bare_path / "kubectl")
