"""Host staging's ring (graphmode.staging): the host never writes a pinned
mirror before the copy launched from it has run, though it records an event
only once per group of mirrors, and a step that stops between taking its
mirror and launching its copy (a hook raising) leaves the ordering whole.

On the emulator's asynchronous, slowed device the Python ring; on a GPU the
C++ ring of graphmode.native, with the device kept busy so that copies lag
behind the host."""

from __future__ import annotations

import threading

import hangs
import pytest
import torch

from graphmode.emulator import stream
from graphmode.native import native_module
from graphmode.ring import GROUP, SLOTS, Ring

STEPS = 4 * SLOTS + 1  # four laps, and a last step in the middle of a group (wait() records for it)
# No step skipped; the last step of a group (its event would be recorded there),
# the first of a group, one of the last lap's.
SKIPPED = [None, GROUP - 1, GROUP, 3 * SLOTS - 1]


def _run(ring, arena, mirrors, skipped, launch_read, between=None):
    """Each step writes its number into its mirror and copies it into the
    arena, then a read of the arena is launched; returns the step numbers
    copied (the reads happen on the device, in launch order)."""
    copied = []
    for step in range(STEPS):
        slot = ring.begin()
        mirrors[slot].fill_(step)
        if step == skipped:  # the step stopped before its copy
            continue
        if between is not None:
            between()  # device work ahead of the copy: it runs late
        ring.copy(arena, mirrors[slot])
        launch_read(step)
        copied.append(step)
    ring.wait()
    return copied


@pytest.mark.parametrize("skipped", SKIPPED)
def test_the_ring_waits_for_every_copy_from_a_mirror_before_the_host_writes_it_again(skipped):
    ring = Ring(torch.device("cpu"), emulated=True)
    mirrors = [torch.zeros(1) for _ in range(SLOTS)]
    arena = torch.zeros(1)
    seen = []
    with stream.asynchronous(delay=0.003):
        copied = _run(ring, arena, mirrors, skipped, lambda step: stream.launch(lambda: seen.append(float(arena))))
        after_wait = float(arena)  # wait() returned: the last copy ran, with no other synchronisation
    assert seen == [float(step) for step in copied]
    assert after_wait == copied[-1]


@pytest.mark.parametrize("skipped", [None, GROUP - 1])
def test_a_step_waits_only_for_the_copies_from_its_own_group(skipped):
    """The device held before every copy: the host runs a whole lap ahead
    without waiting, and the step that starts the first group again waits
    for that group's copies only, not for the later work. A ring that waited
    anywhere else, or for everything launched, would hold the host back."""
    ring = Ring(torch.device("cpu"), emulated=True)
    mirrors = [torch.zeros(1) for _ in range(SLOTS)]
    arena = torch.zeros(1)
    gates = [threading.Event() for _ in range(SLOTS)]  # gate i: the device may run step i's copy
    with stream.asynchronous():
        try:
            for step in range(SLOTS):
                hangs.returns(ring.begin, f"ring.begin() at step {step} of the first lap (it waited for the device)")
                if step == skipped:  # the step stopped before its copy
                    gates[step].set()
                    continue
                stream.launch(gates[step].wait)
                ring.copy(arena, mirrors[step])
            for gate in gates[:GROUP]:
                gate.set()
            hangs.returns(ring.begin, "ring.begin() starting a group (it waited for more than that group's copies)")
        finally:
            for gate in gates:
                gate.set()


@pytest.mark.skipif(not torch.cuda.is_available() or native_module() is None,
                    reason="the C++ ring needs a CUDA device and graphmode.native")
@pytest.mark.parametrize("skipped", SKIPPED)
def test_the_native_ring_waits_for_every_copy_from_a_mirror_on_a_gpu(skipped):
    ring = native_module().Ring(SLOTS, GROUP, torch.cuda.current_device())
    mirrors = [torch.zeros(1, pin_memory=True) for _ in range(SLOTS)]
    arena = torch.zeros(1, device="cuda")
    reads = torch.zeros(STEPS, device="cuda")
    copied = _run(ring, arena, mirrors, skipped, lambda step: reads[step].copy_(arena[0]),
                  between=lambda: torch.cuda._sleep(2_000_000))  # ~1 ms: the host runs far ahead
    torch.cuda.synchronize()
    assert reads[copied].tolist() == [float(step) for step in copied]


@pytest.mark.skipif(not torch.cuda.is_available() or native_module() is None,
                    reason="the C++ ring needs a CUDA device and graphmode.native")
def test_the_native_ring_is_ready_unless_its_next_step_would_wait():
    """The native step takes a step only when the ring's turn will not wait
    (a wait is left to the Python path, which releases the GIL for it)."""
    ring = native_module().Ring(SLOTS, GROUP, torch.cuda.current_device())
    mirrors = [torch.zeros(1, pin_memory=True) for _ in range(SLOTS)]
    arena = torch.zeros(1, device="cuda")
    for step in range(SLOTS):  # a lap whose copies queue behind a busy device
        assert ring.ready(), f"step {step} of the first lap"
        ring.begin()
        torch.cuda._sleep(20_000_000)  # ~10 ms
        ring.copy(arena, mirrors[step])
    assert not ring.ready()  # the next step starts the first group again: its copies have not run
    torch.cuda.synchronize()
    assert ring.ready()
