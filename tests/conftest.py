"""Shared fixtures: which devices this machine can run graphs on."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One pytest-xdist worker per core: a worker's own intra-op threads (and
    # its subprocesses') would only compete with the other workers for cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
elif importlib.util.find_spec("yapf") is not None:
    # lmdeploy imports yapf, which caches its grammar as a pickle in the user's cache directory,
    # written in place (not atomically) when missing or older than the installed grammar: two
    # workers importing it at once for the first time, one reads the other's half-written file
    # (CI, 2026-12-02: "EOFError: Ran out of input" collecting tests/test_lmdeploy_integration.py).
    # The controller, which imports this file before it starts the workers, writes it first.
    import yapf  # noqa: F401

# Imported once, then frozen: torch imports Dynamo at a TorchDispatchMode's first dispatch (the
# emulator's), and every warm-up starts with gc.collect(), which then walks only what tests made.
import torch._dynamo  # noqa: E402

gc.freeze()

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every device with graphs here: the emulator, and CUDA when present."""
    return torch.device(request.param)
