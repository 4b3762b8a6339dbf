"""The example of docs/emulator.md ("An updatable operator"): a vendor's
emulated graph built on the emulator's extension point, whose captured
``add`` calls can be re-issued with new host arguments before a replay.
The docs show the region below word for word (tests/test_writing_a_plugin.py
checks it); tests/test_emulator.py runs it.
"""

from __future__ import annotations

# --8<-- [start:updatable_operator]
import torch

from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord


class UpdatableCall:
    """A step of the recording: one captured call whose arguments an update
    may change before a replay. Its record sits in ``steps`` (nested, so the
    graph's memory and debug dump see it)."""

    def __init__(self):
        self.steps = []

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes):
        record = self.steps[0]  # new arguments, the same outputs
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)


class UpdatableAddGraph(EmulatedGraph):
    """A runtime whose graphs can re-issue their ``add`` calls with a new
    host ``alpha`` (as torch_npu's graph.update re-issues its attention with
    new host kv lengths)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def updatable(self, func):
        """Whether a call of ``func`` is recorded as an updatable step."""
        return func is torch.ops.aten.add.Tensor

    def record_call(self, session, func, args, kwargs):
        if not self.updatable(func):
            return session.record(func, args, kwargs)  # recorded as any device graph records it
        call = UpdatableCall()
        session.append(call)
        with session.nested(call.steps):  # the call's record goes into call.steps
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        self.calls.append(call)
        return outputs
# --8<-- [end:updatable_operator]


# --8<-- [start:host_list_operator]
from typing import List  # noqa: E402, UP035 (torch 2.5 infers a custom operator's host list from typing.List only)


@torch.library.custom_op("acme::paged_decode", mutates_args=())
def paged_decode(query: torch.Tensor, keys: torch.Tensor, kv_lens: List[int]) -> torch.Tensor:  # noqa: UP006
    return query * sum(kv_lens)  # stands for the kernel: its result depends on the host lengths


@paged_decode.register_fake
def _(query, keys, kv_lens):
    return torch.empty_like(query)


class HostListGraph(UpdatableAddGraph):
    """Records each ``acme::paged_decode`` call as an updatable step, as
    UpdatableAddGraph records ``add``: an update re-issues it with new kv_lens."""

    def updatable(self, func):
        return getattr(func, "_schema", None) is not None and func._schema.name == "acme::paged_decode"
# --8<-- [end:host_list_operator]
