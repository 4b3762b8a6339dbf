"""docs/writing-a-plugin.md is real: its Python blocks are regions of the
walkthrough plugin (tests/plugins/walkthrough.py) or of this file (and those
of docs/hooks.md and docs/emulator.md regions of the tests), its TOML
parses, its commands parse; and the plugin passes the conformance suite on
the CPU emulator, plugged in the way the docs show."""

from __future__ import annotations

import argparse
import re
import shlex
import textwrap
from pathlib import Path

import pytest
import torch
from plugins import walkthrough
from torch.utils._pytree import tree_map

import graphmode
from graphmode import ConfigError, hookimpl
from graphmode_conformance import ConformanceTests, Sizes

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "writing-a-plugin.md", ROOT / "docs" / "hooks.md", ROOT / "docs" / "emulator.md"]
SOURCES = [
    ROOT / "tests" / "plugins" / "walkthrough.py", Path(__file__), ROOT / "tests" / "emulated_updates.py",
    ROOT / "tests" / "test_emulator.py", ROOT / "tests" / "plugins" / "fixed_capture_list.py",
]


def regions() -> dict[str, str]:
    """Every ``--8<-- [start:NAME]`` ... ``[end:NAME]`` region of the sources, dedented."""
    found = {}
    for path in SOURCES:
        for name, body in re.findall(r"# --8<-- \[start:(\w+)\]\n(.*?)\n[ \t]*# --8<-- \[end:\1\]", path.read_text(), re.S):
            found[name] = textwrap.dedent(body).strip("\n")
    return found


def blocks(path: Path, language: str) -> list[str]:
    return [b.strip("\n") for b in re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_block_is_a_region_of_the_tested_plugin(doc):
    known = regions()
    for block in blocks(doc, "python"):
        assert block in known.values(), (
            f"{doc.name} has a Python block that is no region of {[p.name for p in SOURCES]} word for word:\n{block}"
        )


def test_the_walkthrough_shows_the_whole_plugin():
    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    source = walkthrough.__file__
    plugin_regions = re.findall(r"# --8<-- \[start:(\w+)\]", Path(source).read_text())
    shown = blocks(ROOT / "docs" / "writing-a-plugin.md", "python")
    missing = [name for name in plugin_regions if regions()[name] not in shown]
    assert not missing, f"docs/writing-a-plugin.md leaves out the plugin's regions {missing}"
    # Outside its regions the module holds only its docstring and the future import.
    rest = re.sub(r"# --8<-- \[start:(\w+)\]\n.*?# --8<-- \[end:\1\]\n", "", Path(source).read_text(), flags=re.S)
    code = rest.split('"""', 2)[2].split("\n")
    assert [line for line in code if line.strip()] == ["from __future__ import annotations"], code
    hooks = sorted(name for name in dir(walkthrough) if name.startswith("graphmode_"))
    unnamed = [hook for hook in hooks if f"`{hook}`" not in text]
    assert not unnamed, f"docs/writing-a-plugin.md shows {unnamed} without naming them"


def test_the_toml_block_declares_the_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    (block,) = blocks(ROOT / "docs" / "writing-a-plugin.md", "toml")
    project = tomllib.loads(block)["project"]
    assert project["entry-points"]["graphmode"] == {"acme": "graphmode_acme.plugin"}
    assert walkthrough.graphmode_vendor_info().name == "acme"


def _cli_parser() -> argparse.ArgumentParser:
    """The ``graphmode`` command's parser, as graphmode.cli.main builds it."""
    from graphmode.cli import vendors
    from graphmode_conformance import cli

    parser = argparse.ArgumentParser(prog="graphmode")
    commands = parser.add_subparsers(dest="command", required=True)
    cli.add_arguments(commands.add_parser("conformance"))
    vendors.add_arguments(commands.add_parser("vendors"))
    return parser


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_graphmode_command_shown_parses(doc):
    parser = _cli_parser()
    commands = [
        line.split("#")[0].strip()
        for block in blocks(doc, "sh")
        for line in block.splitlines()
        if line.startswith("graphmode ")
    ]
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])
    if doc.name == "writing-a-plugin.md":
        assert len(commands) >= 4


def test_the_options_are_typed_and_checked():
    assert walkthrough.ACME_SPEC.make_options({"max_graphs": 4}, "acme") == walkthrough.AcmeOptions(max_graphs=4)
    with pytest.raises(ConfigError, match=r"acme vendor_options max_graphs=0: give an int >= 1"):
        walkthrough.ACME_SPEC.make_options({"max_graphs": 0}, "acme")


def test_kernels_run_in_the_reference_model_before_any_plugin_exists():
    AcmeAttentionOps = walkthrough.AcmeAttentionOps
    # --8<-- [start:try_ops]
    from graphmode.model import ModelConfig, build_reference_model
    from graphmode.model.engine import ReferenceEngine

    config = ModelConfig.tiny()
    model = build_reference_model(config, device="cpu", ops=AcmeAttentionOps())
    engine = ReferenceEngine(num_cache_blocks=33, block_size=32, device="cpu", vocab_size=config.vocab_size)
    cache = model.make_kv_cache(33, 32)
    seqs = [engine.add() for _ in range(4)]
    prefill = engine.prefill(seqs, [5, 40, 17, 64])  # eager: prefill_attention
    decode = engine.decode(seqs)                     # paged_decode_attention
    for step in (prefill, decode):
        logits = model(step.input_ids, step.position_ids, cache, step.attn_metadata)
    # --8<-- [end:try_ops]
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()


# The walkthrough's conformance run, on the CPU emulator at its block size.
# --8<-- [start:suite]
class TestAcmeConformance(ConformanceTests):
    @pytest.fixture
    def vendor(self):
        return graphmode.load_vendor("acme", plugin=walkthrough)  # installed: graphmode.load_vendor("acme")

    @pytest.fixture
    def device(self):
        return torch.device("cpu")  # the emulator; torch.device("acme") on the device

    @pytest.fixture
    def sizes(self):
        return Sizes(block_size=32, table_width=6)  # 6 blocks of 32: 192 tokens per sequence
# --8<-- [end:suite]


# A get_outputs override (section 5): the default wrapped, its cut structure copied.
# --8<-- [start:outputs_wrapper]
@hookimpl(wrapper=True)
def graphmode_get_outputs(meta, batch_size, num_tokens):
    outputs = yield  # the default: every tensor of the model's output cut to num_tokens
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)
# --8<-- [end:outputs_wrapper]

