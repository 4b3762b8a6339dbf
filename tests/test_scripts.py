"""The scripts under scripts/ that measure a GPU (docs/performance.md tells
users to run them) stop on a machine without one with one line saying so
(graphmode.devices), not a traceback from inside torch; every script
is classed here, so a new one is too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

# Each script that needs a GPU, with the arguments that ask for one (its default where none).
NEEDS_GPU = {
    "bench_decode_attention": [], "launch_path": [], "profile_capture": [], "profile_prefill_step": [],
    "profile_step": [], "replay_after_captures": [], "sweep_triton_prefill": [], "lmdeploy_side_by_side": [],
    "check_graph_equals_eager": [], "draft_speed": [], "graph_memory": [], "hf_parity": [], "host_path": [],
    "profile_host_cost": [], "kv_pointer_cost": ["--device", "cuda"], "weight_pointer_cost": ["--device", "cuda"],
    "sleep_wake": ["--device", "cuda"], "capture_time": [],
}
# Scripts that run on the CPU (their CUDA side, if any, only where CUDA is), or are modules of others.
CPU = {"compare_graph_semantics", "debug_cost", "fuzz_steps", "hf_families", "replay_guard_cost", "host_bound",
       "lmdeploy_spec_models", "lmdeploy_vl_model"}


def test_every_script_is_classed():
    scripts = {path.stem for path in SCRIPTS.glob("*.py")}
    assert scripts == set(NEEDS_GPU) | CPU, (
        f"class {sorted(scripts - set(NEEDS_GPU) - CPU)} in tests/test_scripts.py; gone: "
        f"{sorted((set(NEEDS_GPU) | CPU) - scripts)}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("name", sorted(NEEDS_GPU))
def test_a_gpu_script_on_a_machine_without_one_stops_with_one_line(name):
    command = [sys.executable, str(SCRIPTS / f"{name}.py"), *NEEDS_GPU[name]]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                                env=os.environ.copy())
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name}.py ran past the 600 s timeout instead of stopping at once") from None
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"scripts/{name}.py: ") and "no cuda device is available to torch here" in lines[0]
