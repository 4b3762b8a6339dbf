"""The emulator's model of what a busy device does and its synchronous
replay hides: a replay on a stream not ordered after the step's input
copies (``graphmode.emulator.stream_order``), and pinned host memory
rewritten while a copy from it is in flight (``graphmode.emulator.in_flight``).
Each is refused where it happens; the orderings a device accepts pass."""

from __future__ import annotations

import pytest
import torch

from graphmode.emulator import EmulatedGraph, in_flight, mark_host, stream, stream_order
from graphmode.emulator.replay import ReplayHostReadGuard
from graphmode.errors import ReplayError


def _captured(x: torch.Tensor) -> tuple[EmulatedGraph, torch.Tensor]:
    graph = EmulatedGraph()
    with torch.inference_mode(), graph.capture():
        y = x * 2
    return graph, y


def _fill(x: torch.Tensor, value: float) -> None:
    """A fill as the runner runs it: inside the replay guard, on the current stream."""
    guard = ReplayHostReadGuard()
    with guard:
        guard.running("graphmode_fill_buffers")
        x.fill_(value)
        guard.running("the replay")


def test_a_replay_on_a_stream_that_never_waited_for_the_inputs_is_refused():
    x = torch.ones(3)
    graph, _ = _captured(x)
    side = stream_order.Stream("side")
    _fill(x, 5.0)
    with pytest.raises(ReplayError, match="not ordered after the step's input copies"), stream_order.use(side):
        graph.replay()


def test_a_wait_before_the_fill_does_not_order_the_replay_after_it():
    x = torch.ones(3)
    graph, _ = _captured(x)
    side = stream_order.Stream("side")
    side.wait_stream(stream_order.current_stream())  # at construction, say: before this step's copies
    _fill(x, 5.0)
    with pytest.raises(ReplayError, match="not ordered"), stream_order.use(side):
        graph.replay()


@pytest.mark.parametrize("order", ["wait_stream", "wait_event"])
def test_a_replay_stream_waiting_for_the_inputs_replays(order):
    x = torch.ones(3)
    graph, y = _captured(x)
    side = stream_order.Stream("side")
    _fill(x, 5.0)
    if order == "wait_stream":
        side.wait_stream(stream_order.current_stream())
    else:
        side.wait_event(stream_order.OrderEvent().record())
    with stream_order.use(side):
        graph.replay()
    assert y.tolist() == [10.0, 10.0, 10.0]


def _staged(pinned: torch.Tensor, device_buffer: torch.Tensor, values: list[int]) -> None:
    """A vendor's fill staging ``values`` through ``pinned`` into the device buffer."""
    guard = ReplayHostReadGuard()
    with guard:
        guard.running("graphmode_fill_buffers")
        pinned.copy_(mark_host(torch.tensor(values, dtype=pinned.dtype)))  # the engine's host values
        device_buffer.copy_(pinned, non_blocking=True)


def _pinned(n: int) -> torch.Tensor:
    return mark_host(torch.zeros(n, dtype=torch.int32), pinned=True)


def test_one_pinned_buffer_rewritten_while_its_copy_is_in_flight_is_refused():
    pinned, device_buffer = _pinned(3), torch.zeros(3, dtype=torch.int32)
    with in_flight.tracked():
        _staged(pinned, device_buffer, [1, 2, 3])
        with pytest.raises(ReplayError, match=r"read \[1, 2, 3\] when issued, but the host has since written \[4, 5, 6\]"):
            _staged(pinned, device_buffer, [4, 5, 6])


def test_a_pinned_buffer_reused_after_the_host_waited_for_its_copy_is_accepted():
    buffers, device_buffer = [_pinned(3), _pinned(3)], torch.zeros(3, dtype=torch.int32)
    events: list = [None, None]
    with in_flight.tracked():
        for step in range(6):  # two buffers in turn, each reused after an event recorded after its copy
            slot = step % 2
            if events[slot] is not None:
                events[slot].synchronize()
            _staged(buffers[slot], device_buffer, [step, step + 1, step + 2])
            events[slot] = stream.Event().record()
        with pytest.raises(ReplayError, match="in flight"):  # no wait: the copy of step 4 may be in flight
            _staged(buffers[0], device_buffer, [9, 9, 9])
        stream.synchronize()  # every copy has run
        _staged(buffers[0], device_buffer, [7, 7, 7])


def test_outside_back_to_back_steps_the_device_is_idle_between_steps():
    pinned, device_buffer = _pinned(3), torch.zeros(3, dtype=torch.int32)
    _staged(pinned, device_buffer, [1, 2, 3])
    _staged(pinned, device_buffer, [4, 5, 6])
    assert device_buffer.tolist() == [4, 5, 6]
