"""Capture: record every operator below autograd, as a device graph would.

Two modes run while an emulated graph captures:

- a dispatch mode records each aten operator (and each custom operator, as one
  opaque call), runs it so that Python sees real values, and remembers the
  memory it wrote that existed before the capture, to restore it afterwards:
  a device capture runs nothing, so nothing outside the graph may change;
- a function mode refuses host reads of device memory (``.item()``,
  ``.tolist()``, printing, ...), which a device capture cannot contain.

Data-dependent output shapes (``nonzero``, boolean masks) are refused too.

Extension point for a vendor's emulated graph (an :class:`EmulatedGraph`
subclass): the recorder hands every operator call to the graph's
``record_call(session, func, args, kwargs)``, which by default records it with
:meth:`CaptureSession.record`; an override may instead append its own steps
(see ``recording.py`` for what a step is), record into a nested list with
:meth:`CaptureSession.nested`, and remember what it recorded. Ascend's
updatable attention and ACL task groups are built this way, in
``graphmode_ascend.emulated_npu``: the core knows nothing of them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.emulator.host import PAGEABLE_MOVE, is_host, is_pinned_host, mark_derived, mark_host, pageable_move
from graphmode.emulator.recording import OpRecord, frozen_view, is_mutating, written_tensors
from graphmode.errors import CaptureError
from graphmode.tensor_trees import map_tensors, tensors_in

if TYPE_CHECKING:
    from graphmode.emulator.graph import EmulatedGraph

__all__ = [
    "HOST_READS",
    "CaptureSession",
    "ValueSizedOps",
    "call_site",
    "current_session",
    "named_arguments",
    "reads_host",
    "value_sized",
]

aten = torch.ops.aten
_local = threading.local()
_Error = TypeVar("_Error", bound=BaseException)

# Operators whose output shape depends on tensor values: the host must read
# the device to size the result, which a graph capture cannot do.
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten.argwhere.default, aten._unique.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
    aten.equal.default, aten.is_nonzero.default,
}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

# Tensor methods that read device memory on the host.
HOST_READS = frozenset({
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.__repr__,
    torch.Tensor.__str__, torch.Tensor.__format__, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__,
})

#: Frames that are not the caller's: torch's and the emulator's directories,
#: contextlib's file. ("/torch/" in a path would skip the H100 machine's
#: /opt/torch/.venv/lib/.../transformers too, naming the caller's caller.)
_SKIP_FRAMES = (os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), ""),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), ""),
                os.path.abspath(contextlib.__file__))


def current_session() -> CaptureSession | None:
    """The capture under way in this thread, if any."""
    return getattr(_local, "session", None)


def call_site(*also_skip: str) -> str:
    """``file:line in function`` of the innermost caller outside torch, the
    emulator and the files or directories ``also_skip`` (absolute paths):
    where the user's code asked for the operation."""
    skip = _SKIP_FRAMES + also_skip
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(skip):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown>"


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _bound(value: Any) -> Any:
    """A tensor argument as a record keeps it: a view of the memory it has
    now (:func:`frozen_view`), which a later ``set_`` on the tensor object
    does not move. Other values, and tensor subclasses, as they are."""
    if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided:
        return frozen_view(value)
    return value


def named_arguments(func: Any, args: tuple, kwargs: dict) -> dict:
    """All arguments of an operator call by name (so that a vendor's update
    can replace them by name)."""
    named = dict(kwargs)
    for argument, value in zip(func._schema.arguments, args):
        named[argument.name] = value
    return named


class CaptureSession:
    """The state of one emulated capture: where records go, which memory the
    capture allocated, and snapshots of pre-existing memory it wrote."""

    def __init__(self, graph: EmulatedGraph) -> None:
        self.graph = graph
        self.steps: list = []
        self.targets: list[list] = [self.steps]
        self.allocated: set[int] = set()
        self.snapshots: dict[int, tuple[Any, Any]] = {}
        self.in_operator = False
        self.error: BaseException | None = None
        move = lambda: self.fail(CaptureError(PAGEABLE_MOVE.format(site=call_site())))  # noqa: E731
        self._modes = (HostReadGuard(self.refuse_host_read, lambda: self.in_operator, move), _Recorder(self))

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        if current_session() is not None:
            raise CaptureError(
                "another graph is capturing in this thread; end that capture first "
                "(captures do not nest, on a device either)"
            )
        _local.session = self
        for mode in self._modes:
            mode.__enter__()

    def stop(self) -> None:
        try:
            for mode in reversed(self._modes):
                mode.__exit__(None, None, None)
        finally:
            _local.session = None
            # A device capture runs nothing: undo every write the warm
            # capture made to memory that existed before it.
            for storage, saved in self.snapshots.values():
                storage.copy_(saved)
            self.snapshots.clear()

    def fail(self, error: _Error) -> _Error:
        self.error = error
        return error

    # -- recording ----------------------------------------------------------

    def append(self, step: Any) -> None:
        """Add a step (see ``recording.py``) where the capture records now."""
        self.targets[-1].append(step)

    @contextlib.contextmanager
    def nested(self, steps: list) -> Iterator[list]:
        """Record into ``steps`` (a nested step's list) within this block."""
        self.targets.append(steps)
        try:
            yield steps
        finally:
            self.targets.pop()

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Record one operator call as a device capture would, run it, and
        return its outputs: the default of ``EmulatedGraph.record_call``.

        Contract, for a vendor graph's ``record_call`` that calls it:

        - It appends one :class:`OpRecord` where the capture records now
          (the session's steps, or the list of the innermost
          :meth:`nested` block) and returns the call's outputs, real values
          computed now. Return exactly those: replays write into them, and
          the captured forward holds them.
        - The record's ``args``/``kwargs`` are what every replay re-issues.
          To make an operator updatable, record it alone in a nested list,
          keep that list, and before a replay replace its record by
          ``OpRecord(func, args, new_kwargs, record.outputs,
          record.targets)``: replays then write into the same outputs.
        - Host tensors given to device work are cloned: the graph keeps
          their capture-time values, as a device freezes host values at
          launch; change them by replacing the record, not the host tensor.
          A call whose tensors are all host memory runs once, now, and is
          not recorded (its results are host values).
        - A ``copy_`` between pinned host memory and the device, with
          ``non_blocking=True``, is recorded as a transfer that reads the
          host memory at every replay; pageable or blocking ones raise
          :class:`CaptureError`.
        - Memory that existed before the capture and that the call writes
          is restored when the capture stops (a device capture runs
          nothing); memory the call allocates belongs to the graph.
        """
        tensors = tensors_in((args, kwargs))
        host = [t for t in tensors if is_host(t)]
        if host and len(host) == len(tensors):
            # Work on host memory runs on the host, at capture time only: its
            # results are host values, frozen like any other.
            self.in_operator = True
            try:
                outputs = func(*args, **kwargs)
            finally:
                self.in_operator = False
            for tensor in tensors_in(outputs):
                mark_host(tensor)
            return outputs
        # A copy between host and device memory is a memcpy node: it reads (or
        # writes) the host memory at every replay, so its host tensor is not frozen.
        transfer = bool(host) and func is aten.copy_.default and self._check_transfer(func, args, kwargs)
        input_keys = {_storage_key(t) for t in tensors}
        if is_mutating(func):
            for tensor in written_tensors(func, args, kwargs):
                key = _storage_key(tensor)
                if key not in self.allocated and key not in self.snapshots:
                    storage = tensor.untyped_storage()
                    self.snapshots[key] = (storage, storage.clone())
        self.in_operator = True
        try:
            outputs = func(*args, **kwargs)
        finally:
            self.in_operator = False
        # Keep our own containers: the caller may reuse its lists. A host
        # tensor given to device work is read when the work is launched, so
        # the graph keeps the value it had at capture.
        if host and not transfer:
            args, kwargs = map_tensors(lambda x: x.clone() if is_host(x) else x, (args, kwargs))
        # A device kernel is launched with the memory its tensors had at
        # capture: memory given to a tensor object later (``k.set_(other)``,
        # ``k.data = other``) is not what the graph reads.
        args, kwargs = map_tensors(_bound, (args, kwargs))
        targets = map_tensors(frozen_view, outputs)
        self.append(OpRecord(func, args, kwargs, outputs, targets))
        if not is_mutating(func):
            for tensor in tensors_in(outputs):
                key = _storage_key(tensor)
                if key not in input_keys:
                    self.allocated.add(key)
        return outputs

    def _check_transfer(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """A ``copy_`` between host and device memory inside a capture, as
        PyTorch's CUDA copy allows it: only from or to pinned host memory
        (pytorch aten/src/ATen/native/cuda/Copy.cu refuses pageable memory
        during capture), and only ``non_blocking`` (a blocking copy
        synchronises the stream, which a capture cannot contain)."""
        named = named_arguments(func, args, kwargs)
        destination, source = named["self"], named["src"]
        host = source if is_host(source) else destination
        if not is_pinned_host(host):
            raise self.fail(
                CaptureError(
                    "copy between pageable host memory and device memory inside graph capture: "
                    "a device graph can only copy from or to pinned host memory (CUDA refuses "
                    "it: 'Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                    f"unless the CPU tensor is pinned'). Called at {call_site()}. Pin the host "
                    "tensor (tensor.pin_memory(), or graphmode.buffers.host_zeros(..., pinned=True)), "
                    "or copy before the capture."
                )
            )
        if not named.get("non_blocking", False):
            raise self.refuse("a blocking copy between host and device memory", "it synchronises the stream")
        return True

    # -- refusing host synchronisation -------------------------------------

    def refuse(self, what: str, reason: str) -> CaptureError:
        return self.fail(
            CaptureError(
                f"{what} inside graph capture ({reason}): a device graph cannot "
                f"capture a host read of device memory. Called at {call_site()}. "
                "Keep host reads out of the captured forward: compute on the device, or read a host "
                "copy prepared before the step (a plugin's: a buffer declared BufferSpec(host=True))."
            )
        )

    def refuse_host_read(self, what: str) -> CaptureError:
        return self.refuse(what, "a device-to-host read")


class _Recorder(TorchDispatchMode):
    def __init__(self, session: CaptureSession) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        session = self.session
        if func is aten._local_scalar_dense.default:
            if is_host(args[0]):
                return func(*args, **kwargs)
            raise session.refuse(f"{func} (.item())", "a device-to-host read")
        sized = value_sized(func, args, kwargs)
        if sized is not None:
            raise session.refuse(sized, "its output size depends on tensor values")
        return session.graph.record_call(session, func, args, kwargs)


def value_sized(func: Any, args: tuple, kwargs: dict) -> str | None:
    """``func`` as errors name it if its output size depends on tensor
    values (which no device graph can capture, on any device), else None."""
    if func in _DATA_DEPENDENT:
        return str(func)
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if func in _BOOL_INDEXED and any(t.dtype in (torch.bool, torch.uint8) for t in tensors_in(indices)):
        return f"{func} with a boolean mask"
    return None


class ValueSizedOps(TorchDispatchMode):
    """Records, without refusing, the first operator run under it whose output
    size depends on tensor values, and where it was called (``found``: the
    operator and ``file:line in function``): a forward a graph's capture
    would refuse, known before any capture."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[str, str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            sized = value_sized(func, args, kwargs)
            if sized is not None:
                self.found = (sized, call_site())
        return func(*args, **kwargs)


class HostReadGuard(TorchFunctionMode):
    """Refuses host reads of device memory (:data:`HOST_READS`, ``.to("cpu")``)
    while entered: ``refuse(what)`` makes the error raised; ``exempt()`` says
    when a call is the emulator's own (an operator running for the recorder);
    ``refuse_move()``, given in a capture, the error for a move of pageable
    host memory to the device (:func:`pageable_move`)."""

    def __init__(self, refuse: Callable[[str], BaseException], exempt: Callable[[], bool] = lambda: False,
                 refuse_move: Callable[[], BaseException] | None = None) -> None:
        super().__init__()
        self.refuse, self.exempt, self.refuse_move = refuse, exempt, refuse_move  # refuse_move: a capture's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refuse_move is not None and not self.exempt() and pageable_move(func, args, kwargs):
            raise self.refuse_move()
        if reads_host(func, args, kwargs) and not self.exempt():
            name = getattr(func, "__name__", str(func))
            raise self.refuse(f"Tensor.{name}()")
        result = func(*args, **kwargs)
        mark_derived(func, args, kwargs, result)
        return result


def reads_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` reads device memory on the host."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if func in HOST_READS or (func is torch.Tensor.to and _targets_cpu(args[1:], kwargs)):
        return not is_host(args[0])
    return False


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves to the host.

    Only a device *named* as a string ("cpu"), or a host tensor to match, says
    so. A ``torch.device`` object is the tensor's own device in
    device-agnostic code (``x.to(device=y.device)``, HF's rotary embedding):
    on a GPU that move is a no-op inside a capture, so it is one here too,
    although on the emulator ``y.device`` is the CPU. The two cannot be told
    apart, so ``.to(torch.device("cpu"))`` passes here (use ``.cpu()`` or
    ``.to("cpu")`` for host copies; both are refused)."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, torch.Tensor) and is_host(value):
            return True
        if isinstance(value, str):
            try:
                if torch.device(value).type == "cpu":
                    return True
            except RuntimeError:
                continue
    return False
