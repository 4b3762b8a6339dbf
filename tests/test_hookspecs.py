"""Every hook is specified, documented and exercised (as datasette checks
its plugin hooks)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from graphmode import hookspecs

ROOT = Path(__file__).resolve().parent.parent
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("graphmode_"))
SOURCES = "\n".join(
    path.read_text()
    for folder in ("tests", "conformance")
    for path in (ROOT / folder).rglob("*.py")
    if path.name != "test_hookspecs.py"
)


def test_there_are_hooks():
    assert len(HOOKS) == 14


@pytest.mark.parametrize("name", HOOKS)
def test_hook_states_its_call_semantics(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert "Stops at the first non-None result" in doc or "Every implementation is called" in doc, doc


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    parameters = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    assert f"`{name}({parameters})`" in (ROOT / "docs" / "hooks.md").read_text()


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_exercised_by_a_test(name):
    assert name in SOURCES, f"no test or conformance check calls or implements {name}"


@pytest.mark.parametrize("name", HOOKS)
def test_the_default_plugin_implements_every_hook_but_the_vendor_only_ones(name):
    from graphmode import default

    vendor_only = {"graphmode_check_config", "graphmode_update_graph_params", "graphmode_capture_error"}
    assert hasattr(default, name) != (name in vendor_only)
