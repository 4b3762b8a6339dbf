"""Operators that return nothing exist for a side effect; a device graph
repeats them at every replay, and so must the emulator."""

from __future__ import annotations

import pytest
import torch

from graphmode.emulator import EmulatedGraph


def test_a_device_side_assertion_is_checked_at_every_replay():
    lengths = torch.tensor([3, 5])
    graph = EmulatedGraph()
    with graph.capture():
        torch._assert_async((lengths <= 8).all(), "a length is above 8")
    graph.replay()
    lengths[1] = 9
    with pytest.raises(RuntimeError, match="a length is above 8"):
        graph.replay()
