"""Graph-semantics cases, run on the CPU emulator and on real CUDA graphs.

Each case takes a :class:`Backend` and returns an observation (plain data).
``EXPECTED`` says what a device graph must show; a case whose answer differs
by nature between CUDA and the emulator has one expectation per side and
says why. ``tests/test_graph_semantics.py`` checks every case on every
available device; ``scripts/compare_graph_semantics.py`` prints them side by
side for the record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphmode.buffers import host_zeros
from graphmode.graphs import DeviceGraph, make_device_graph
from graphmode.meta import GraphMeta


@dataclass
class Backend:
    device: torch.device

    @property
    def name(self) -> str:
        return "emulator" if self.device.type == "cpu" else self.device.type

    def graph(self) -> DeviceGraph:
        return make_device_graph(self.device)

    def tensor(self, values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def host(self, values) -> torch.Tensor:
        """A host tensor, as a vendor's host buffer is made."""
        meta = GraphMeta(max_batchs=1, max_tokens=1, num_blocks=1, block_size=1, device=self.device)
        tensor = host_zeros(meta, (len(values),), torch.int64)
        tensor.copy_(torch.tensor(values))
        return tensor

    def pinned(self, values) -> torch.Tensor:
        """A pinned (page-locked) host tensor, as host staging's mirror is made."""
        meta = GraphMeta(max_batchs=1, max_tokens=1, num_blocks=1, block_size=1, device=self.device)
        tensor = host_zeros(meta, (len(values),), torch.int64, pinned=True)
        tensor.copy_(torch.tensor(values))
        return tensor

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def values(tensor: torch.Tensor) -> list:
    return tensor.detach().cpu().tolist()


def case_live_buffer_read(b: Backend):
    """A tensor the graph read at capture is read again, live, at replay."""
    x = b.tensor([1.0, 2.0, 3.0])
    g = b.graph()
    with g.capture():
        y = x * 2
    x.copy_(b.tensor([10.0, 20.0, 30.0]))
    g.replay()
    b.sync()
    return values(y)


def case_in_place_write(b: Backend):
    """In-place writes land in the captured tensor at every replay; the
    capture itself changes nothing."""
    x = b.tensor([0.0, 0.0])
    g = b.graph()
    with g.capture():
        x.add_(1)
    after_capture = values(x)
    g.replay()
    g.replay()
    b.sync()
    return {"after_capture": after_capture, "after_two_replays": values(x)}


def case_output_identity(b: Backend):
    """The output object returned at capture holds each replay's result."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    with g.capture():
        y = x + 1
    pointer = y.data_ptr()
    results = []
    for value in (5.0, 7.0):
        x.fill_(value)
        g.replay()
        b.sync()
        results.append(values(y))
    return {"same_memory": y.data_ptr() == pointer, "results": results}


def case_frozen_python_scalar(b: Backend):
    """A Python number used at capture is a constant of the graph."""
    settings = {"scale": 3.0}
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    with g.capture():
        y = x * settings["scale"]
    settings["scale"] = 100.0
    g.replay()
    b.sync()
    return values(y)


def case_frozen_host_list(b: Backend):
    """Host memory read on the host inside the capture (a kernel's host
    argument, Ascend's kv lengths) is frozen at its captured value."""
    lengths = b.host([4, 5, 6])
    x = b.tensor([0.0, 0.0, 0.0])
    g = b.graph()
    with g.capture():
        as_list = lengths.tolist()
        y = x + as_list[1]
    lengths.copy_(torch.tensor([40, 50, 60]))
    g.replay()
    b.sync()
    return values(y)


def case_host_work_runs_at_capture(b: Backend):
    """Work on host memory inside the capture runs once, on the host, at
    capture time; its result is a constant of the graph."""
    lengths = b.host([4, 5, 6])
    x = b.tensor([0.0, 0.0])
    g = b.graph()
    with g.capture():
        total = lengths.sum()
        y = x + total.item()
    lengths.copy_(torch.tensor([40, 50, 60]))
    g.replay()
    b.sync()
    return values(y)


def case_host_list_index(b: Backend):
    """A Python list used as a device index needs a host-to-device copy of
    pageable memory during capture. By nature the sides differ: CUDA refuses
    the copy inside stream capture; the emulator has no device, so the list
    becomes a constant of the graph (frozen)."""
    x = b.tensor([1.0, 2.0, 3.0, 4.0])
    g = b.graph()
    try:
        with g.capture():
            y = x[[0, 2]] * 1
    except Exception as error:  # noqa: BLE001 - the observation is the failure
        return {"raised": type(error).__name__}
    x.copy_(b.tensor([10.0, 20.0, 30.0, 40.0]))
    g.replay()
    b.sync()
    return {"result": values(y)}


def case_view_of_static_buffer(b: Backend):
    """A view of a static buffer keeps aliasing it; work on the view reads
    the buffer live."""
    buffer = b.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    g = b.graph()
    with g.capture():
        window = buffer[1:4]
        y = window * 10
    buffer.copy_(b.tensor([5.0, 6.0, 7.0, 8.0, 9.0]))
    g.replay()
    b.sync()
    return {"view": values(window), "result": values(y)}


def case_replay_after_batch_buffers_changed(b: Backend):
    """The runner's pattern: refill a fixed buffer for a smaller batch (live
    rows copied, padding rows reset) and replay."""
    ids = b.tensor([0, 0, 0, 0], dtype=torch.int64)
    table = b.tensor([[10.0], [20.0], [30.0], [40.0], [50.0]])
    g = b.graph()
    with g.capture():
        rows = table[ids] + 1
    ids[:2].copy_(b.tensor([4, 3], dtype=torch.int64))
    ids[2:].fill_(0)
    g.replay()
    b.sync()
    return values(rows.flatten())


def case_dtype_conversion_is_recomputed(b: Backend):
    """A conversion (``.long()``) of a static buffer is recomputed at replay,
    not frozen."""
    index = b.tensor([0, 1], dtype=torch.int32)
    table = b.tensor([1.0, 2.0, 3.0])
    g = b.graph()
    with g.capture():
        y = table[index.long()]
    index.copy_(b.tensor([2, 2], dtype=torch.int32))
    g.replay()
    b.sync()
    return values(y)


def case_host_sync_raises(b: Backend):
    """Reading device memory on the host inside a capture fails."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    try:
        with g.capture():
            (x.sum() * 2).item()
    except Exception:  # noqa: BLE001 - CUDA raises RuntimeError, the emulator CaptureError
        return "raised"
    return "did not raise"


def case_shared_pool(b: Backend):
    """Two graphs captured into one pool both replay correctly in capture
    order, the second reading the first's output."""
    x = b.tensor([1.0, 2.0])
    first, second = b.graph(), b.graph()
    with first.capture():
        y = x * 2
    with second.capture(pool=first.pool()):
        z = y + 1
    x.copy_(b.tensor([3.0, 4.0]))
    first.replay()
    second.replay()
    b.sync()
    return {"same_pool": first.pool() == second.pool(), "y": values(y), "z": values(z)}


def case_reset_and_recapture(b: Backend):
    """After reset the same graph object captures new work."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    with g.capture():
        _first = x * 2
    g.replay()
    g.reset()
    with g.capture():
        z = x * 3
    x.copy_(b.tensor([5.0, 6.0]))
    g.replay()
    b.sync()
    return values(z)


def case_random_is_fresh(b: Backend):
    """Random operators draw new numbers at every replay."""
    g = b.graph()
    with g.capture():
        r = torch.rand(8, device=b.device)
    g.replay()
    b.sync()
    first = values(r)
    g.replay()
    b.sync()
    return first != values(r)


def case_frozen_size(b: Backend):
    """Sizes computed on the host at capture are frozen (a kernel's max
    length read from the host is the classic stale-value bug)."""
    lengths = b.tensor([2, 3], dtype=torch.int64)
    limit = {"max_len": 3}
    g = b.graph()
    with g.capture():
        positions = torch.arange(limit["max_len"], device=b.device)
        visible = (positions[None, :] < lengths[:, None]).sum(dim=1)
    lengths.copy_(b.tensor([5, 5], dtype=torch.int64))
    limit["max_len"] = 5
    g.replay()
    b.sync()
    return values(visible)


def case_pinned_copy_in_capture_is_live(b: Backend):
    """A non-blocking copy from pinned host memory inside a capture is a
    memcpy node: every replay reads the host memory as it is then (host
    staging's one copy). The capture itself copies nothing."""
    mirror = b.pinned([1, 2, 3])
    arena = b.tensor([0, 0, 0], dtype=torch.int64)
    g = b.graph()
    with g.capture():
        arena.copy_(mirror, non_blocking=True)
        y = arena * 2
    after_capture = values(arena)
    results = []
    for new in ([10, 20, 30], [4, 5, 6]):
        mirror.copy_(torch.tensor(new))  # a host write, no device work
        g.replay()
        b.sync()
        results.append(values(y))
    return {"after_capture": after_capture, "replays": results}


def case_pageable_copy_in_capture_refused(b: Backend):
    """A copy from pageable host memory inside a capture is refused (torch
    2.11's CUDA copy checks that the host tensor is pinned; the emulator
    raises CaptureError), even non-blocking."""
    source = b.host([1, 2, 3])
    x = b.tensor([0, 0, 0], dtype=torch.int64)
    g = b.graph()
    try:
        with g.capture():
            x.copy_(source, non_blocking=True)
    except Exception as error:  # noqa: BLE001 - CUDA raises RuntimeError, the emulator CaptureError
        return {"raised": isinstance(error, RuntimeError), "says pinned": "pinned" in str(error)}
    return "did not raise"


def case_pageable_move_to_device_in_capture_refused(b: Backend):
    """A host tensor moved to the device inside a capture (``.to(x.device)``,
    cumulative starts computed from host lengths) is a host-to-device copy
    of pageable memory: refused (CUDA's copy checks that the host tensor is
    pinned; the emulator raises CaptureError). Before 2026-11-26 the
    emulator ran the move once, at capture, and froze the value moved."""
    lengths = b.host([1, 2, 3])
    x = b.tensor([0, 0, 0], dtype=torch.int64)
    g = b.graph()
    try:
        with g.capture():
            x + lengths.cumsum(0).to(x.device)
    except Exception as error:  # noqa: BLE001 - CUDA raises RuntimeError, the emulator CaptureError
        return {"raised": isinstance(error, RuntimeError), "says pinned": "pinned" in str(error)}
    return "did not raise"


def case_blocking_copy_in_capture_refused(b: Backend):
    """A blocking copy from pinned host memory inside a capture is refused:
    it synchronises the stream (CUDA: cudaStreamSynchronize during capture)."""
    source = b.pinned([1, 2, 3])
    x = b.tensor([0, 0, 0], dtype=torch.int64)
    g = b.graph()
    try:
        with g.capture():
            x.copy_(source)
    except Exception as error:  # noqa: BLE001 - CUDA raises a RuntimeError subclass, the emulator CaptureError
        return {"raised": isinstance(error, RuntimeError)}
def case_no_op_device_move_is_live(b: Backend):
    """A move to where a tensor already is (``x.to(device=x.device)``, as
    HF's rotary embedding moves its ``inv_freq``; ``.to(x.dtype)``) is a no-op
    inside a capture: the graph reads the tensor live. A real conversion on
    the device (to float64 and back) is recomputed."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    with g.capture():
        same = x.to(device=x.device, dtype=torch.float32) + x.to(x.device) + x.to(torch.float32)
        converted = x.to(x.device, torch.float64).float() * 10
    x.copy_(b.tensor([3.0, 4.0]))
    g.replay()
    b.sync()
    return {"no_op_moves": values(same), "conversion": values(converted)}


def case_host_copy_raises(b: Backend):
    """Copying device memory to the host (``.cpu()``) inside a capture fails."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    try:
        with g.capture():
            (x * 2).cpu()
    except Exception:  # noqa: BLE001 - CUDA raises RuntimeError, the emulator CaptureError
        return "raised"
    return "did not raise"


def case_to_host_raises(b: Backend):
    """``.to("cpu")`` of device memory inside a capture fails, like ``.cpu()``."""
    x = b.tensor([1.0, 2.0])
    g = b.graph()
    try:
        with g.capture():
            (x * 2).to("cpu")
    except Exception:  # noqa: BLE001 - CUDA raises RuntimeError, the emulator CaptureError
        return "raised"
    return "did not raise"


def case_memory_moved_under_a_tensor(b: Backend):
    """A graph reads the memory it captured, not whatever storage a tensor
    object points to at replay: after ``k.set_(other)`` or ``k.data = other``
    (a KV cache given new memory in place) the replay still reads, and
    writes, the old memory. (Aliases keep the old memory alive, so that
    reading it is defined on CUDA too.)"""
    k, v = b.tensor([1.0, 2.0]), b.tensor([0.0, 0.0])
    old_k, old_v = k.view_as(k), v.view_as(v)
    g = b.graph()
    with g.capture():
        y = k * 2
        v.add_(1)
    k.set_(b.tensor([7.0, 8.0]))
    v.data = b.tensor([50.0, 50.0])
    old_k.copy_(b.tensor([3.0, 4.0]))
    g.replay()
    b.sync()
    return {"read": values(y), "old written": values(old_v), "new left": values(v)}


# Cases that fail a capture run last: a failed CUDA capture must not be what
# breaks the cases after it.
_FAILING = (
    "host_list_index",
    "host_sync_raises",
    "pageable_copy_in_capture_refused",
    "pageable_move_to_device_in_capture_refused",
    "blocking_copy_in_capture_refused",
    "host_copy_raises",
    "to_host_raises",
)
CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
CASES = {**{k: v for k, v in CASES.items() if k not in _FAILING}, **{k: CASES[k] for k in _FAILING}}

EXPECTED = {
    "live_buffer_read": [20.0, 40.0, 60.0],
    "in_place_write": {"after_capture": [0.0, 0.0], "after_two_replays": [2.0, 2.0]},
    "output_identity": {"same_memory": True, "results": [[6.0, 6.0], [8.0, 8.0]]},
    "frozen_python_scalar": [3.0, 6.0],
    "frozen_host_list": [5.0, 5.0, 5.0],
    "host_work_runs_at_capture": [15.0, 15.0],
    "host_list_index": {
        "cuda": {"raised": "RuntimeError"},
        "emulator": {"result": [10.0, 30.0]},
    },
    "view_of_static_buffer": {"view": [6.0, 7.0, 8.0], "result": [60.0, 70.0, 80.0]},
    "replay_after_batch_buffers_changed": [51.0, 41.0, 11.0, 11.0],
    "dtype_conversion_is_recomputed": [3.0, 3.0],
    "host_sync_raises": "raised",
    "shared_pool": {"same_pool": True, "y": [6.0, 8.0], "z": [7.0, 9.0]},
    "reset_and_recapture": [15.0, 18.0],
    "random_is_fresh": True,
    "frozen_size": [3, 3],
    "pinned_copy_in_capture_is_live": {"after_capture": [0, 0, 0], "replays": [[20, 40, 60], [8, 10, 12]]},
    "pageable_copy_in_capture_refused": {"raised": True, "says pinned": True},
    "pageable_move_to_device_in_capture_refused": {"raised": True, "says pinned": True},
    "blocking_copy_in_capture_refused": {"raised": True},
    "no_op_device_move_is_live": {"no_op_moves": [9.0, 12.0], "conversion": [30.0, 40.0]},
    "host_copy_raises": "raised",
    "to_host_raises": "raised",
    "memory_moved_under_a_tensor": {"read": [6.0, 8.0], "old written": [1.0, 1.0], "new left": [50.0, 50.0]},
}

# Cases whose expectation differs by nature between CUDA and the emulator.
PER_SIDE = {"host_list_index"}


def expected(case: str, backend: Backend):
    value = EXPECTED[case]
    return value[backend.name] if case in PER_SIDE else value


def run(case: str, backend: Backend):
    return CASES[case](backend)
