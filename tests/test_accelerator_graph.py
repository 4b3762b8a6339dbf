"""Which graph class drives an accelerator: ``torch.accelerator.Graph`` only
where torch registered a graph implementation for the device type, else the
device module's own class.

Each case runs ``accelerator_backend.py`` in a fresh process, on a real torch
accelerator registered from Python (``pyaccel``), with and without a C++
graph implementation registered in ATen's registry.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hangs
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not hasattr(getattr(torch, "accelerator", None), "Graph"),
    reason=f"torch {torch.__version__} has no torch.accelerator.Graph (2.12+): the device module's class is the only path",
)

SCRIPT = Path(__file__).with_name("accelerator_backend.py")


def _run(*args: str) -> dict:
    # The child inherits this interpreter and its environment; it must see no
    # real accelerator, so that pyaccel is the current one.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    # The C++ case builds an extension first (about 40 s in CI).
    done = hangs.run([sys.executable, str(SCRIPT), *args], ci_seconds=45, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_a_registered_implementation_the_device_modules_graph_captures():
    """As on CUDA with torch 2.12 and 2.13: the class exists, the device is the
    current accelerator, and ATen refuses to construct one."""
    result = _run()
    assert result == {
        "accelerator_graph_available": False,
        "adapter": "TorchGraph",
        "graph_class": "PyAccelGraph",
        "backend_log": ["capture_begin pool=5,1 mode=thread_local", "capture_end", "replay"],
    }


def test_with_a_registered_implementation_torch_accelerator_graph_captures():
    """As on XPU: the pool and the capture mode reach the backend through
    ``torch.accelerator.Graph`` (GraphCaptureMode::ThreadLocal is 2)."""
    result = _run("--graph-impl")
    assert result == {
        "accelerator_graph_available": True,
        "adapter": "AcceleratorGraph",
        "graph_class": "Graph",
        "backend_log": ["capture_begin pool=5,1 mode=2", "capture_end", "replay"],
    }
