"""README.md's API example is examples/quickstart.py, word for word, and it
runs as written: its decode steps replay graphs, and its tokens equal an
eager run's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hangs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "quickstart.py"


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The API in one example"):]
    section = section[:section.index("\n## ")]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block.strip("\n")


def test_the_readme_shows_the_quickstart_word_for_word():
    code = EXAMPLE.read_text().split('"""', 2)[2].strip("\n")  # all but the module docstring
    assert _readme_block() == code, "README.md's API example and examples/quickstart.py differ: update one from the other"
    assert "python examples/quickstart.py" in (ROOT / "README.md").read_text()


def _run(**env: str) -> list[str]:
    # Deprecated names are errors here: the example shows the current API.
    # A first run in a fresh venv builds the native step (about 30 s in CI).
    result = hangs.run(
        [sys.executable, "-W", "error::DeprecationWarning", str(EXAMPLE)], ci_seconds=40,
        capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "GRAPHMODE_VENDOR": "", "GRAPHMODE_EXECUTE_MODE": "", **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def test_the_quickstart_runs_as_written_and_its_graphs_give_the_eager_tokens():
    tokens, stats = _run()
    assert stats.startswith("8 captures (8 in warm-up), 8 replays, eager steps: 1 prefill;"), stats
    eager_tokens, eager_stats = _run(GRAPHMODE_EXECUTE_MODE="eager")
    assert eager_stats.startswith("0 captures"), eager_stats
    assert tokens.startswith("tokens per sequence: [[") and tokens == eager_tokens
