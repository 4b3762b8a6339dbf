"""The emulator behaves like a device graph: every case of
``graph_semantics_cases`` gives the expected observation on the emulator, and
on real CUDA graphs when a GPU is present; without one,
scripts/compare_graph_semantics.py says its CUDA side was skipped."""

from __future__ import annotations

import graph_semantics_cases as cases
import pytest
import torch


@pytest.mark.parametrize("case", list(cases.CASES))
def test_case(case, device):
    backend = cases.Backend(device)
    assert cases.run(case, backend) == cases.expected(case, backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to compare against")
@pytest.mark.parametrize("case", sorted(set(cases.CASES) - cases.PER_SIDE))
def test_emulator_agrees_with_cuda(case):
    emulator = cases.run(case, cases.Backend(torch.device("cpu")))
    cuda = cases.run(case, cases.Backend(torch.device("cuda")))
    assert emulator == cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_the_comparison_script_without_cuda_claims_no_agreement(capsys):
    """scripts/compare_graph_semantics.py with only the emulator side: the
    CUDA side is reported skipped and why, and no case is said to agree."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "compare_graph_semantics.py"
    spec = importlib.util.spec_from_file_location("compare_graph_semantics", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"CUDA side skipped: torch {torch.__version__} ")
    assert not any(line.split()[-1] == "agree" for line in lines if line and not line.startswith(" "))
    assert lines[-1] == "all cases as expected on the emulator; the CUDA side was skipped"
