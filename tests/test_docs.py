"""README.md and docs/ point at what exists: every relative link reaches a
file and every #anchor a heading (or an ``<a id>``) of it; every
repository file, ``file.py::test`` and ``test_name`` it names exists; every
``graphmode`` command and every script or example command their code blocks
show parses with today's options; the counts and tables of broken plugins
are those of tests/broken_plugins.py and tests/shipped_bugs.py, and the
graph-semantics cases those of tests/graph_semantics_cases.py. Text only:
nothing here runs a model (under a second)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import broken_plugins
import graph_semantics_cases
import pytest
import shipped_bugs

from graphmode.cli.main import COMMANDS, _command

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NUMBERS = {13: "thirteen", 44: "forty-four", 45: "forty-five", 46: "forty-six", 47: "forty-seven",
           48: "forty-eight", 51: "fifty-one", 56: "fifty-six", 61: "sixty-one", 66: "sixty-six", 75: "seventy-five", 76: "seventy-six", 77: "seventy-seven", 14: "fourteen", 15: "fifteen"}


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of ``path``: each heading lowercased, its punctuation
    but ``-`` and ``_`` dropped, spaces as ``-``, repeats numbered; and every
    ``<a id="...">``."""
    text = FENCE.sub("", path.read_text())
    found, seen = set(re.findall(r'<a (?:id|name)="([^"]+)"', text)), dict[str, int]()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading of {file.name} makes #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


def _commands(prefix: str) -> list[tuple[Path, str]]:
    """Every line of a ``sh`` block of the docs that starts with ``prefix``,
    its comment cut off."""
    return [
        (doc, line.split(" #")[0].strip())
        for doc in DOCS
        for block in re.findall(r"^```sh\n(.*?)^```", doc.read_text(), re.S | re.M)
        for line in block.splitlines()
        if line.startswith(prefix)
    ]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_graphmode_command_shown_parses(name):
    parser = argparse.ArgumentParser(prog=f"graphmode {name}")
    _command(name, parser)
    shown = [(doc, command) for doc, command in _commands(f"graphmode {name}")]
    assert shown, f"no doc shows graphmode {name}"
    for doc, command in shown:
        try:
            parser.parse_args(shlex.split(command)[2:])
        except SystemExit:
            pytest.fail(f"{doc.relative_to(ROOT)} shows `{command}`, which graphmode {name} refuses")


def _options(source: Path) -> set[str]:
    """The options a script's argparse parser takes (``--no-x`` too where
    ``--x`` is a BooleanOptionalAction)."""
    text = source.read_text()
    options = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", text))
    options |= {f"--no-{o[2:]}" for o in re.findall(r"add_argument\(\s*\"(--[\w-]+)\"[^)]*BooleanOptionalAction", text)}
    return options


def test_every_script_option_shown_exists():
    shown = _commands("python ") + [(doc, command.split("&& ")[-1]) for doc, command in _commands("pip install")
                                    if "&& python " in command] + _commands("torchrun ")
    checked = 0
    for doc, command in shown:
        words = shlex.split(command)
        if "-m" in words:
            module = words[words.index("-m") + 1]
            source = ROOT / "conformance" / (module.replace(".", "/") + ".py")
        else:
            source = ROOT / next(word for word in words if word.endswith(".py"))
        assert source.exists(), f"{doc.relative_to(ROOT)} shows `{command}`: no {source.relative_to(ROOT)}"
        unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in _options(source)]
        unknown = [w for w in unknown if w != "--nproc-per-node"]  # torchrun's own
        assert not unknown, f"{doc.relative_to(ROOT)} shows `{command}`: {source.name} takes no {unknown}"
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("module", [broken_plugins, shipped_bugs], ids=lambda m: m.__name__)
def test_the_broken_plugin_counts_and_tables_match_the_modules(module):
    """README.md and docs/conformance.md count the plugins in words, and the
    table of docs/conformance.md has a row for each."""
    count = NUMBERS.get(len(module.BROKEN), str(len(module.BROKEN)))
    name = f"tests/{module.__name__}.py"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{count} {'broken plugins' if module is broken_plugins else 'bugs that vendor'}" in readme, (
        f"README.md does not count {len(module.BROKEN)} ({count}) in {name}"
    )
    text = (ROOT / "docs" / "conformance.md").read_text()
    assert f"`{name}` holds {count} " in text, f"docs/conformance.md does not count {count} in {name}"
    section = text.split(f"`{name}` holds")[1].split("\n\n")[1:]
    table = next(part for part in section if part.startswith("| "))
    rows = [row.split(" | ")[0].lstrip("| ").split(" (")[0] for row in table.splitlines()[2:]]
    assert sorted(rows) == sorted(module.BROKEN), (
        f"docs/conformance.md's table for {name} differs from it: "
        f"missing {sorted(set(module.BROKEN) - set(rows))}, extra {sorted(set(rows) - set(module.BROKEN))}"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_file_and_test_named_exists(doc):
    """A path the doc names under tests/, scripts/, examples/, core/,
    conformance/ or vendors/ exists; a ``file.py::name`` names a function or
    class of that file."""
    missing = []
    for path, _, names in re.findall(
        r"\b((?:tests|scripts|examples|core|conformance|vendors)/[\w/.-]+\.py)((?:::(\w+))*)", doc.read_text()
    ):
        file = ROOT / path
        if not file.exists():
            missing.append(path)
        elif names and not re.search(rf"^\s*(?:def|class) {names}\b", file.read_text(), re.M):
            missing.append(f"{path}::{names}")
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def test_every_test_the_docs_name_exists():
    """A ``test_name`` in the docs is a test function or a test module here
    (torch_npu's upstream test file and the docs' example module aside)."""
    sources = [p for d in ("tests", "conformance", "vendors") for p in (ROOT / d).rglob("*.py")]
    defined = {name for p in sources for name in re.findall(r"^\s*def (test_\w+)", p.read_text(), re.M)}
    defined |= {p.stem for p in sources} | {"test_aclgraph_update", "test_xyz_conformance"}
    named = {(doc.relative_to(ROOT), name) for doc in DOCS for name in re.findall(r"\b(test_\w+)", doc.read_text())}
    missing = sorted(f"{doc}: {name}" for doc, name in named if name not in defined)
    assert not missing, f"the docs name tests that do not exist: {missing}"


def test_the_emulator_doc_counts_the_graph_semantics_cases():
    text = (ROOT / "docs" / "emulator.md").read_text()
    assert f"`tests/graph_semantics_cases.py` holds {len(graph_semantics_cases.CASES)} cases" in text, (
        f"docs/emulator.md miscounts tests/graph_semantics_cases.py's {len(graph_semantics_cases.CASES)} cases"
    )
