"""What a forward run outside any capture shows a capture would refuse.

:class:`~graphmode.emulator.capture.ValueSizedOps` records the first operator
whose output size depends on tensor values; :class:`HostReads` records the
first host read of device memory (the reads
:class:`~graphmode.emulator.capture.HostReadGuard` refuses in a capture). A
model adapter runs its load-time probe under both, to refuse graph modes when
a runner is built rather than at the first capture. Living in the emulator
package, both name the caller's line, not their own (``call_site``).
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from graphmode.emulator.capture import call_site, reads_host


class HostReads(TorchFunctionMode):
    """Records, without refusing, the first host read of device memory run
    under it (``.tolist()``, ``.item()``, a tensor as a Python bool or int)
    and where it was called (``found``: the call and ``file:line in
    function``)."""

    found: tuple[str, str] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and reads_host(func, args, kwargs):
            self.found = (f"Tensor.{getattr(func, '__name__', func)}()", call_site())
        return func(*args, **kwargs)
