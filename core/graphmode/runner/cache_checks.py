"""Checks of what a graph captured by reference, before every replay (the
same KV-cache tensor objects, with the memory they had at capture; the
same extra inputs), and of the KV cache where it first meets the runner
(that it fits the model; that warmup() gets the graphs' cache).

Host facts only: shapes, dtypes, the Python objects and their data pointers.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphmode.context import StepInputs
from graphmode.errors import InputError
from graphmode.runner.validate import cache_geometry, check_cache_layout

__all__ = ["CacheFit", "CacheMemory", "check_same_objects", "check_warmup_cache"]


class CacheMemory:
    """The data pointers of a graph's KV-cache tensors at capture.

    The identity check (the same tensor objects) cannot see memory given to
    the same object (``k.set_(other)``, ``k.data = other``), but a device
    graph keeps reading and writing the old address. One list of pointers
    is compared per replay, read with ``const_data_ptr`` (no copy-on-write
    materialisation, and about a third cheaper than ``data_ptr``);
    ``scripts/kv_pointer_cost.py`` measures it (docs/architecture.md, Errors)."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        self.pointers = list(map(_data_ptr, self.tensors))

    def unchanged(self) -> bool:
        """Whether every cache tensor still has its memory of capture time."""
        return list(map(_data_ptr, self.tensors)) == self.pointers

    def check(self, graph: str) -> None:
        """Refuse a replay of ``graph`` (as errors name it) when a cache
        tensor's memory moved since capture."""
        if list(map(_data_ptr, self.tensors)) == self.pointers:  # unchanged(), inlined: every replay
            return
        index = next(i for i, (t, p) in enumerate(zip(self.tensors, self.pointers)) if _data_ptr(t) != p)
        raise InputError(
            f"past_key_values tensor {index} of {len(self.tensors)} has new memory (data_ptr "
            f"{_data_ptr(self.tensors[index]):#x}, captured at {self.pointers[index]:#x}) under the same "
            f"tensor object (tensor.set_(...), tensor.data = ...): the graph of {graph} would keep reading and "
            "writing the old memory. Change the cache in place (.copy_()), or call runner.reset() after "
            "reallocating the cache"
        )


# const_data_ptr reads the address without materialising a copy-on-write
# tensor; torch builds without it (none in the supported range, 2.5+, that we
# know of) fall back to data_ptr.
_data_ptr = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)
_UNSEEN = object()


def check_same_objects(captured: Any, inputs: StepInputs) -> None:
    """A graph reads what it captured: a new KV cache (or a cache tensor
    replaced inside the same container) or a changed extra input without a
    buffer would be silently ignored, so refuse it."""
    now, then = captured.flatten_cache(inputs.past_key_values), captured.cache_tensors
    if len(now) != len(then) or not all(map(operator.is_, now, then)):
        changed = next((i for i, (a, b) in enumerate(zip(now, then)) if a is not b), min(len(now), len(then)))
        raise InputError(
            f"past_key_values are not the tensors the graph of {captured.name} captured "
            f"(tensor {changed} of {len(then)} differs; {len(now)} given): the graph would keep "
            "reading and writing the old cache. Call runner.reset() after reallocating or "
            "replacing any KV-cache tensor"
        )
    captured.memory.check(captured.name)
    # Declared step inputs have buffers; every other extra is frozen by the graph.
    given = {n: v for n, v in inputs.extras.items() if n not in captured.meta.spec.names} if inputs.extras else {}
    if given or captured.extras:
        if given.keys() != captured.extras.keys():
            _refuse_other_extras(captured, sorted(given))
        for name, value in captured.extras.items():
            if given[name] is not value:
                raise InputError(
                    f"extra model input {name!r} is not the object the graph of "
                    f"{captured.name} captured; graphs freeze extra inputs that have no buffer. "
                    "Keep it fixed, or declare it as a step input (build_graph_runner(step_inputs="
                    "[BufferSpec(...)]), docs/engines.md) so that every step's value is copied in"
                )


def _refuse_other_extras(captured: Any, given: list[str]) -> None:
    """A step passing other undeclared extra inputs (by name) than the graph captured."""
    then = sorted(captured.extras)
    if captured.in_warmup:
        fix = (
            "runner.warmup() captures with the extras given to it: pass the ones the steps pass, "
            "runner.warmup(past_key_values, " + ", ".join(f"{n}=..." for n in given) + ")"
        )
    else:
        fix = "pass the same extra inputs at every decode step, or call runner.reset() to capture again"
    raise InputError(
        f"this step passes extra model inputs {given}, but the graph of {captured.name} was captured "
        f"with {then}{' (by warmup())' if captured.in_warmup else ''}: graphs freeze extra inputs. {fix}"
    )


class CacheFit:
    """Where the KV cache first meets the runner (every step, and warmup()):
    refuse a cache the model would misread. Checked once per cache: later
    steps passing the same container, or the same tensors, cost an identity
    check. What a cache must be comes from the model's own ``make_kv_cache``
    (a small one on the ``meta`` device, made once), in the layout of its
    attention ops: a model without them is not checked beyond ``None``."""

    def __init__(self, model: Any, block_size: int) -> None:
        self.model, self.block_size = model, block_size
        self.geometry = cache_geometry(model)
        self._expected: list[torch.Tensor] | None = None
        self._last: Any = _UNSEEN
        self._last_leaves: list[Any] = []

    def __call__(self, past_key_values: Any) -> None:
        if past_key_values is self._last:
            return
        if past_key_values is None:
            raise InputError(
                "past_key_values is None; pass the KV cache (one (key, value) pair per layer, made with "
                "model.make_kv_cache(num_cache_blocks, block_size)) with every step"
            )
        leaves = _leaves(past_key_values)
        if len(leaves) != len(self._last_leaves) or not all(map(operator.is_, leaves, self._last_leaves)):
            self._check(past_key_values, leaves)
        self._last, self._last_leaves = past_key_values, leaves

    def forget(self) -> None:
        """Drop the last cache seen (``runner.reset()``): an engine
        reallocating its cache frees the old one before making the new."""
        self._last, self._last_leaves = _UNSEEN, []

    def _check(self, past_key_values: Any, leaves: list[Any]) -> None:
        check_cache_layout(self.model, leaves, self.block_size)
        expected = self._reference()
        if expected is None:
            return
        layers = len(getattr(self.model, "layers", ()))
        if layers and isinstance(past_key_values, (list, tuple)) and len(past_key_values) != layers:
            raise InputError(
                f"past_key_values has {len(past_key_values)} layers, but the model has {layers}: the missing "
                "layers would be skipped (or the extra ones ignored) silently. Make the cache with "
                "model.make_kv_cache(num_cache_blocks, block_size)"
            )
        if len(leaves) != len(expected):
            raise InputError(
                f"past_key_values holds {len(leaves)} tensors, but the model's make_kv_cache gives "
                f"{len(expected)}; make the cache with model.make_kv_cache(num_cache_blocks, block_size)"
            )
        blocks = self.geometry.blocks_dim if self.geometry is not None else 0
        for index, (tensor, want) in enumerate(zip(leaves, expected)):
            if not isinstance(tensor, torch.Tensor):
                continue
            shape, wanted = list(tensor.shape), list(want.shape)
            if len(shape) == len(wanted):
                shape[blocks] = wanted[blocks] = -1
            if shape != wanted:
                raise InputError(
                    f"KV-cache tensor {index} has shape {tuple(tensor.shape)}, but the model's make_kv_cache "
                    f"gives {tuple(want.shape)} (blocks aside: dimension {blocks} is the block count) in the "
                    "layout of its attention ops: another head count, head size or layout would be misread. "
                    "Make the cache with model.make_kv_cache(num_cache_blocks, block_size)"
                )
            if tensor.dtype != want.dtype:
                raise InputError(
                    f"KV-cache tensor {index} has dtype {tensor.dtype}, but the model's make_kv_cache gives "
                    f"{want.dtype} (the model's dtype): the kernels would store its keys and values rounded, "
                    "or misread them. Make the cache with model.make_kv_cache(num_cache_blocks, block_size), or "
                    f"convert the model to {tensor.dtype}"
                )

    def _reference(self) -> list[torch.Tensor] | None:
        """The tensors of a 2-block cache of the model's, on ``meta`` (no memory)."""
        if self._expected is None:
            make = getattr(self.model, "make_kv_cache", None)
            if make is None or self.geometry is None:
                return None
            self._expected = tree_flatten(make(2, self.block_size, device="meta"))[0]
        return self._expected


def _leaves(past_key_values: Any) -> list[Any]:
    """The cache's tensors in order; a list of (key, value) pairs without a
    general tree flatten (a fraction of its cost)."""
    if isinstance(past_key_values, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in past_key_values):
        return [t for pair in past_key_values for t in pair]
    return tree_flatten(past_key_values)[0]


def check_warmup_cache(graphs: list[Any], past_key_values: Any) -> None:
    """The cache given to ``runner.warmup()`` (the runner checked that it
    fits the model) is the cache the runner's graphs (every family's)
    captured, if any: otherwise the runner would hold graphs on two caches,
    and steps on either would be refused."""
    now = _leaves(past_key_values)
    for captured in graphs:
        then = captured.cache_tensors
        if len(now) != len(then) or not all(map(operator.is_, now, then)):
            raise InputError(
                f"warmup() with another KV cache than the runner's graphs captured (the graph of {captured.name} holds "
                "other tensors): the runner would hold graphs on two caches. Pass the cache the graphs captured, or call runner.reset() "
                "first (after reallocating the cache)"
            )
