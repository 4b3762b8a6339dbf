"""The plugin API is what docs/hooks.md ("What a plugin may import") lists:
every listed name imports from the module it is listed under, every
graphmode name the shipped vendors, the test plugins and the code of
docs/writing-a-plugin.md import is listed."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest
import torch
from setups import tiny_setup

import graphmode

ROOT = Path(__file__).resolve().parent.parent
HOOKS_MD = ROOT / "docs" / "hooks.md"


def _table(after: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after the line ``after``."""
    text = HOOKS_MD.read_text()
    rest = text[text.index(after):]
    rows = re.search(r"^\|.*\|\n\|[-| ]+\|\n((?:\|.*\|\n?)+)", rest, re.M)
    assert rows, f"docs/hooks.md has no table after {after!r}"
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in rows.group(1).splitlines()]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def documented() -> dict[str, list[str]]:
    """module -> names, from the API table."""
    listed: dict[str, list[str]] = {}
    for module, names, _ in _table("## What a plugin may import"):
        (module,) = _names(module)
        listed.setdefault(module, []).extend(_names(names))
    return listed


def test_the_api_table_lists_the_core_modules_a_plugin_uses():
    listed = documented()
    for module in ("graphmode", "graphmode.spec", "graphmode.buffers", "graphmode.graphs", "graphmode.errors"):
        assert listed.get(module), f"docs/hooks.md lists nothing from {module}"
    assert {"hookimpl", "VendorInfo", "GraphMeta"} <= set(listed["graphmode"])
    assert {"GraphSpec", "BufferSpec"} <= set(listed["graphmode.spec"])
    assert {"stage", "host_zeros"} <= set(listed["graphmode.buffers"])


@pytest.mark.parametrize("module", sorted(documented()))
def test_every_documented_name_imports_from_its_module_without_a_warning(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a listed name is current, not deprecated
        imported = importlib.import_module(module)
        missing = [name for name in documented()[module] if not hasattr(imported, name)]
    assert not missing, f"docs/hooks.md lists {missing} under {module}, which has no such names"


def _graphmode_imports(source: str) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "graphmode":
            found.update((node.module, alias.name) for alias in node.names)
    return found


def _doc_imports(path: Path) -> set[tuple[str, str]]:
    """The graphmode names a doc's Python code blocks import, and its inline
    code that is an import (`from graphmode.buckets import FixedSizes`)."""
    text = path.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    inline = re.findall(r"`(from graphmode[\w.]* import [^`]+)`", text)
    return set().union(*(_graphmode_imports(code) for code in [*blocks, *inline]))


def _undocumented(used: set[tuple[str, str]]) -> list[str]:
    listed = documented()
    return sorted(f"{module}.{name}" for module, name in used if name not in listed.get(module, []))


def test_every_graphmode_name_the_shipped_and_test_plugins_import_is_documented():
    sources = [*sorted(ROOT.glob("vendors/*/graphmode_*/*.py")), *sorted((ROOT / "tests" / "plugins").glob("*.py"))]
    assert len(sources) > 20
    used = set().union(*(_graphmode_imports(path.read_text()) for path in sources))
    assert ("graphmode.buckets", "FixedSizes") in used  # tests/plugins/fixed_capture_list.py
    undocumented = _undocumented(used)
    assert not undocumented, f"plugins import {undocumented}, which docs/hooks.md does not list"


def test_every_graphmode_name_writing_a_plugin_imports_is_documented():
    used = _doc_imports(ROOT / "docs" / "writing-a-plugin.md")
    assert {("graphmode.spec", "GraphSpec"), ("graphmode.buckets", "FixedSizes")} <= used
    undocumented = _undocumented(used)
    assert not undocumented, f"docs/writing-a-plugin.md imports {undocumented}, which docs/hooks.md does not list"


def test_an_unknown_buffers_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'padding_row'"):
        graphmode.buffers.padding_row  # noqa: B018


def test_stage_with_meta_copies_without_a_warning():
    setup = tiny_setup(max_batches=4, capture_batch_sizes=[4])
    seqs = setup.prefill(4)
    setup.decode(seqs)
    meta = setup.runner.graph_meta()
    lengths = meta.input_buffers["kv_seqlens"]
    with torch.inference_mode():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            graphmode.buffers.stage(meta, [(lengths[:2], torch.tensor([3, 4], dtype=lengths.dtype))])
    assert lengths[:2].tolist() == [3, 4]
    with pytest.raises(TypeError, match="takes a GraphMeta first"):
        graphmode.buffers.stage([(lengths[:1], lengths[1:2])], [])
