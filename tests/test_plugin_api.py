"""The plugin API is what docs/hooks.md ("What a plugin may import") lists:
every listed name imports from the module it is listed under, every
graphmode name the shipped vendors, the test plugins and the code of
docs/writing-a-plugin.md import is listed, and every deprecated name still works, as before, with a
DeprecationWarning naming its replacement."""

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


def deprecated_rows() -> list[tuple[str, list[str], str]]:
    return [(_names(name)[0], _names(modules), replacement) for name, modules, replacement in _table("Deprecated, working")]


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


# -- deprecated names -----------------------------------------------------------


def test_the_deprecated_table_is_what_graphmode_buffers_deprecates():
    rows = {name: modules for name, modules, _ in deprecated_rows()}
    from graphmode.buffers import DEPRECATED

    in_buffers = {name for name, modules in rows.items() if modules == ["graphmode.buffers"] and "(" not in name}
    assert in_buffers == set(DEPRECATED)


@pytest.mark.parametrize("name", ["padding_rows", "decode_rows", "TOKEN_BUFFERS", "ROW_BUFFERS"])
def test_a_deprecated_buffers_name_imports_with_a_warning_naming_its_replacement(name):
    from graphmode.buffers import DEPRECATED

    with pytest.warns(DeprecationWarning, match=rf"graphmode\.buffers\.{name} is deprecated .*; use ") as caught:
        value = getattr(importlib.import_module("graphmode.buffers"), name)
    assert DEPRECATED[name] in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning points at the plugin's line
    assert value is not None


def test_an_unknown_buffers_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'padding_row'"):
        graphmode.buffers.padding_row  # noqa: B018


def _old_default_fill(meta, inputs, batch_size, bucket):
    """The built-in fill hook as it was written before the declarations
    (commit 74dafc9^, core/graphmode/default.py), from the helpers of the
    time: what a plugin copied from it calls."""
    from graphmode.buffers import ROW_BUFFERS, TOKEN_BUFFERS, decode_rows, padding_rows, stage

    stage(
        decode_rows(meta, inputs, batch_size)
        + padding_rows(meta, TOKEN_BUFFERS, batch_size, bucket, dim=1)
        + padding_rows(meta, ROW_BUFFERS, batch_size, bucket)
    )
    return True


class _OldPlugin:
    """A plugin whose fill hook is written against the old helpers; it
    declares host_staging, as the old docs told such a plugin to."""

    @graphmode.hookimpl
    def graphmode_vendor_info(self):
        return graphmode.VendorInfo(
            "oldapi", ("cuda",), "torch", None, False, "test", capabilities=frozenset({"host_staging"})
        )

    @graphmode.hookimpl
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        return _old_default_fill(meta, inputs, batch_size, bucket)


@pytest.mark.parametrize("host_inputs", [False, True], ids=["device fill", "host staging"])
def test_a_plugin_written_against_the_old_helpers_still_gives_graph_equal_eager(host_inputs):
    """Graph equals eager across buckets, a smaller batch after a larger one
    (padding rows reset) and, with host staging, every write routed through
    the pinned mirror by the old ``stage(pairs)`` (a direct write into the
    arena would be overwritten by the graph's copy and replay stale rows)."""
    setup = tiny_setup("oldapi", plugin=_OldPlugin(), host_inputs=host_inputs, capture_batch_sizes=[1, 2, 4, 8, 16])
    with pytest.warns(DeprecationWarning) as caught:
        seqs = setup.prefill(8)
        for batch in (8, 5, 3, 8, 1, 6):
            graph, eager = setup.decode(seqs[:batch])
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")
    assert setup.caches_close()
    assert (setup.runner.staging is not None) == host_inputs
    assert setup.runner.stats.replays == 3  # 5, the second 8 and 6 replay the graph of bucket 8
    messages = {str(w.message) for w in caught}
    assert any("graphmode.buffers.stage(pairs) is deprecated" in m and "stage(meta, pairs)" in m for m in messages)
    assert any("graphmode.buffers.padding_rows is deprecated" in m for m in messages)


def test_padding_rows_pairs_each_buffer_range_with_its_padding():
    setup = tiny_setup(max_batches=4, capture_batch_sizes=[4])
    seqs = setup.prefill(4)
    setup.decode(seqs)  # makes and fills the buffers
    meta = setup.runner.graph_meta()
    with pytest.warns(DeprecationWarning):
        from graphmode.buffers import padding_rows
    pairs = padding_rows(meta, ["kv_seqlens", "block_offsets"], 1, 3)
    assert [tuple(d.shape) for d, _ in pairs] == [(2,), (2, 8)]
    for (destination, padding), name in zip(pairs, ["kv_seqlens", "block_offsets"]):
        assert destination.data_ptr() == meta.input_buffers[name][1:3].data_ptr()
        assert torch.equal(padding, meta.padding_buffers[name][1:3])
    assert padding_rows(meta, ["kv_seqlens"], 3, 3) == []


def test_stage_with_pairs_only_copies_and_warns_and_stage_with_meta_does_not_warn():
    setup = tiny_setup(max_batches=4, capture_batch_sizes=[4])
    seqs = setup.prefill(4)
    setup.decode(seqs)
    meta = setup.runner.graph_meta()
    lengths = meta.input_buffers["kv_seqlens"]
    with torch.inference_mode():
        with pytest.warns(DeprecationWarning, match=r"stage\(pairs\) is deprecated .*use graphmode\.buffers\.stage\(meta, pairs\)"):
            graphmode.buffers.stage([(lengths[:2], torch.tensor([7, 9], dtype=lengths.dtype))])
        assert lengths[:2].tolist() == [7, 9]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            graphmode.buffers.stage(meta, [(lengths[:2], torch.tensor([3, 4], dtype=lengths.dtype))])
    assert lengths[:2].tolist() == [3, 4]
    with pytest.raises(TypeError, match="takes a GraphMeta first"):
        graphmode.buffers.stage([(lengths[:1], lengths[1:2])], [])
