"""Shared fixtures: which devices this machine can run graphs on."""

from __future__ import annotations

import gc
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

# Imported once, then frozen: torch imports Dynamo at a TorchDispatchMode's first dispatch (the
# emulator's), and every warm-up starts with gc.collect(), which then walks only what tests made.
import torch._dynamo  # noqa: E402

gc.freeze()

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every device with graphs here: the emulator, and CUDA when present."""
    return torch.device(request.param)
