"""Tensor parallel graph mode on the CPU: two processes on gloo, emulated
graphs with the all-reduces recorded inside them. Each run is under a hang
catch (tests/hangs.py), so a hang fails the test instead of stalling CI."""

from __future__ import annotations

import re
import subprocess
import sys

import hangs
import pytest

pytestmark = pytest.mark.slow


# The longest run here takes about this long in CI.
CI_SECONDS = 40


def torchrun(*args: str) -> subprocess.CompletedProcess:
    # A collective that hangs times out inside the run, at half the run's
    # bound, so gloo's own error says which collective waited.
    collective = str(int(hangs.bound(CI_SECONDS) / 2))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "graphmode_conformance.tensor_parallel", "--device", "cpu", "--timeout", collective, *args]
    return hangs.run(command, ci_seconds=CI_SECONDS, capture_output=True, text=True)


def test_graph_equals_eager_at_tp2_and_tp2_matches_tp1():
    result = torchrun("--batches", "1-8,12,16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10/10 batch sizes bitwise identical" in result.stdout
    assert "PASS" in result.stdout


def test_ranks_with_different_capture_lists_raise_naming_both():
    result = torchrun("--scenario", "different-capture-lists")
    assert result.returncode == 0, result.stdout + result.stderr
    message = "tensor-parallel ranks disagree on graph mode: rank 0: graph mode, buckets [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]; rank 1: graph mode, buckets [1, 2, 4]"
    assert result.stdout.count(message) == 2  # both ranks say it


def test_ranks_running_different_batches_raise_instead_of_hanging():
    result = torchrun("--scenario", "different-batches")
    assert result.returncode == 0, result.stdout + result.stderr
    message = "tensor-parallel ranks disagree on the step to run: rank 0: batch 2 (bucket 2); rank 1: batch 1 (bucket 1)"
    assert result.stdout.count(message) == 2


def test_ranks_running_different_graph_variants_raise_instead_of_hanging():
    result = torchrun("--scenario", "different-variants", "--batches", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    message = ("tensor-parallel ranks disagree on the step to run: rank 0: batch 2 (bucket 2, plain); "
               "rank 1: batch 2 (bucket 2, microbatch=True)")
    assert result.stdout.count(message) == 2, result.stdout


def test_ranks_running_a_full_and_a_piecewise_graph_of_one_size_raise_instead_of_hanging():
    # Rank 0 decodes 8 sequences (full bucket 8), rank 1 prefills 8 tokens (token bucket 8).
    result = torchrun("--execute-mode", "full_and_piecewise", "--scenario", "different-families", "--batches", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    message = "tensor-parallel ranks disagree on the step to run: rank 0: batch 8 (bucket 8); rank 1: tokens 8 (bucket 8)"
    assert result.stdout.count(message) == 2


def test_full_and_piecewise_at_tp2_equals_eager_and_tp1():
    # Piecewise graphs were refused with a process group; now the ranks agree on every token bucket.
    result = torchrun("--execute-mode", "full_and_piecewise", "--batches", "1-4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "full_and_piecewise mode" in result.stdout
    assert "4/4 batch sizes bitwise identical" in result.stdout
    assert "eager steps: none" in result.stdout  # every prefill in a piecewise graph, every decode in a full graph
    replays = re.search(r"prefills: (\d+) replays of (\d+) piecewise graphs", result.stdout)
    assert replays and int(replays[1]) > 0 and int(replays[2]) > 0, result.stdout
    assert "PASS" in result.stdout
