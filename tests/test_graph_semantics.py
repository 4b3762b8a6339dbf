"""The emulator behaves like a device graph: every case of
``graph_semantics_cases`` gives the expected observation on the emulator, and
on real CUDA graphs when a GPU is present."""

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
