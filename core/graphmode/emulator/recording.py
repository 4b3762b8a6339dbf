"""What an emulated graph records, and how each record replays.

A recording is a list of steps. Each operator record knows how it replays:

- views (and ops whose result shares its input's memory) are skipped: their
  result keeps aliasing the same fixed memory, as on a device;
- operators that write into their arguments run again as recorded, and so do
  operators that return nothing (``torch._assert_async``): they exist for a
  side effect, which a device graph repeats at every replay;
- other operators write their result into the tensors the capture returned,
  through their ``out=`` overload when there is one, else by a copy.

Extension point: a step is any object with ``replay_step()``, returning a
no-argument callable that redoes it (or None to skip it). A step holding
nested steps exposes them as ``steps`` (walked for the graph's memory and
its debug dump) and compiles them itself; ``describe()`` names it in the
debug dump. A vendor's graph appends such steps through
:class:`graphmode.emulator.capture.CaptureSession` (Ascend's task groups and
event waits live in ``graphmode_ascend.emulated_npu``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.tensor_trees import tensors_in

__all__ = ["OpRecord", "compile_steps", "is_mutating", "is_view", "written_tensors"]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


_out_variants: dict[Any, tuple[Any, list[str]] | None] = {}


def out_variant(func: torch._ops.OpOverload) -> tuple[Any, list[str]] | None:
    """The ``out=`` overload of a functional operator and its out-argument
    names, or None. Matched by argument names and types, since overload names
    vary (``add.Tensor`` -> ``add.out``, ``mul.Scalar`` -> ``mul.Scalar_out``)."""
    if func in _out_variants:
        return _out_variants[func]
    schema = func._schema
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    found = None
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = [a.name for a in arguments if a.is_out]
        if not outs or len(outs) != len(schema.returns):
            continue
        if [(a.name, str(a.type)) for a in arguments if not a.is_out] == wanted:
            found = (candidate, outs)
            break
    _out_variants[func] = found
    return found


def changes_metadata_only(func: torch._ops.OpOverload) -> bool:
    """In-place view operators (``squeeze_``, ``t_``) change a tensor's shape,
    not its memory: done once at capture, never again."""
    return torch.Tag.inplace_view in getattr(func, "tags", ())


def frozen_view(tensor: torch.Tensor) -> torch.Tensor:
    """A view with ``tensor``'s current shape and strides, unaffected by later
    in-place view operators on ``tensor`` itself."""
    return tensor.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def is_mutating(func: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def written_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator call writes into, per its schema."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.name in kwargs else (
            args[index] if index < len(args) else None
        )
        written.extend(tensors_in(value))
    return written


def is_view(func: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclass
class OpRecord:
    """One operator call: ``func(*args, **kwargs)`` returned ``outputs``.

    ``targets`` are views of the outputs as they were returned, which replay
    writes into (the outputs themselves may be reshaped in place later)."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: Any
    targets: Any = None

    def replay_step(self) -> Callable[[], None] | None:
        """A no-argument callable that redoes this call, or None to skip it."""
        func, args, kwargs = self.func, self.args, self.kwargs
        if changes_metadata_only(func):
            return None
        if is_mutating(func) or not func._schema.returns:
            return _bind(func, args, kwargs)
        outputs = tensors_in(self.outputs)
        if not outputs:
            return None  # a host-side answer (sizes, strides): frozen
        # Views keep aliasing the same fixed memory: nothing to recompute. The
        # memory decides, not the schema: ``to`` or ``reshape`` may alias or copy.
        inputs = {_storage_key(t) for t in tensors_in((args, kwargs))}
        if all(_storage_key(t) in inputs for t in outputs):
            return None
        targets = self.targets if self.targets is not None else self.outputs
        variant = out_variant(func)
        if variant is not None:
            out_func, out_names = variant
            out_kwargs = dict(kwargs)
            results = targets if isinstance(targets, (tuple, list)) else (targets,)
            out_kwargs.update(zip(out_names, results))
            return _bind(out_func, args, out_kwargs)
        return _copy_back(func, args, kwargs, targets)

    def describe(self) -> str:
        """``func(arguments) -> outputs``, tensors as dtype and shape."""
        args = ", ".join([_show(a) for a in self.args] + [f"{k}={_show(v)}" for k, v in self.kwargs.items()])
        return f"{self.func}({args}) -> {_show(self.outputs)}"


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _bind(func: Any, args: tuple, kwargs: dict) -> Callable[[], None]:
    call = getattr(func, "_op", func)  # skip OpOverload's Python frame
    return lambda: call(*args, **kwargs)


def _copy_back(func: Any, args: tuple, kwargs: dict, outputs: Any) -> Callable[[], None]:
    call = getattr(func, "_op", func)
    if func.namespace == "_c10d_functional":
        # A functional collective returns before it completes; wait for it
        # before copying its result into the tensor the graph captured.
        wait = torch.ops._c10d_functional.wait_tensor.default
        collective = call
        call = lambda *a, **k: wait(collective(*a, **k))  # noqa: E731
    if isinstance(outputs, torch.Tensor):
        target = outputs

        def copy_one() -> None:
            target.copy_(call(*args, **kwargs))

        return copy_one
    targets = list(outputs)

    def step() -> None:
        for target, result in zip(targets, call(*args, **kwargs)):
            if isinstance(target, torch.Tensor):
                target.copy_(result)

    return step


def compile_steps(steps: list) -> list[Callable[[], None]]:
    """The callables a replay runs, in order, skipping what needs no work."""
    compiled = []
    for step in steps:
        call = step.replay_step()
        if call is not None:
            compiled.append(call)
    return compiled
