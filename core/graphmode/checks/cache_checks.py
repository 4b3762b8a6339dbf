"""Checks of what a graph captured by reference, before every replay (the
same KV-cache tensor objects, with the memory they had at capture; the
same extra inputs), and of the KV cache where it first meets the runner
(that it fits the model; that warmup() gets the graphs' cache).

Host facts only: shapes, dtypes, the Python objects and their data pointers.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from graphmode.checks.fingerprints import Fingerprints
from graphmode.checks.validate import cache_geometry, check_cache_layout
from graphmode.context import KVCache, StepInputs
from graphmode.errors import InputError

if TYPE_CHECKING:
    from graphmode.families.family import Captured

__all__ = ["CacheFit", "CacheMemory", "FrozenExtras", "cache_flattener", "check_same_objects", "check_warmup_cache"]


class CacheMemory:
    """The KV-cache tensors a graph captured: the objects, and the memory and
    layout they had then.

    A device graph reads and writes the addresses it captured, in the layout
    it captured. Per replay, two passes over the step's cache tensors: the
    same objects (a replaced tensor, or another cache), and the same data
    pointers (memory given to the same object, ``k.set_(other)``,
    ``k.data = other``, which a graph ignores), read with ``const_data_ptr``
    (no copy-on-write materialisation). A new tensor object over the
    captured memory in the captured shape, strides and dtype (a view an
    engine makes each step) is read right by the graph and passes, compared
    leaf by leaf; any other is refused. ``scripts/kv_pointer_cost.py``
    measures the check (docs/architecture.md, Errors)."""

    def __init__(self, leaves: list[Any], flatten: Callable[[Any], list[Any]]) -> None:
        self.leaves, self.flatten = leaves, flatten
        self.pointers = [_data_ptr(t) if isinstance(t, torch.Tensor) else t for t in leaves]

    def check(self, past_key_values: KVCache, graph: str) -> None:
        """Refuse a replay of ``graph`` (as errors name it) on a cache that is
        not at the addresses, or in the layout, it captured."""
        now, then = self.flatten(past_key_values), self.leaves
        if len(now) == len(then) and all(map(operator.is_, now, then)):
            try:
                if list(map(_data_ptr, now)) == self.pointers:
                    return
            except TypeError:  # a leaf that is not a tensor: compared one by one below
                pass
        for index, (given, captured, pointer) in enumerate(zip(now, then, self.pointers)):
            if given is captured and not isinstance(captured, torch.Tensor):
                continue
            if not isinstance(captured, torch.Tensor) or not isinstance(given, torch.Tensor):
                _refuse_other_cache(graph, f"tensor {index} of {len(then)} differs", len(now))
            if _data_ptr(given) != pointer:
                if given is captured:
                    raise InputError(
                        f"past_key_values tensor {index} of {len(then)} has new memory (data_ptr "
                        f"{_data_ptr(given):#x}, captured at {pointer:#x}) under the same tensor object "
                        f"(tensor.set_(...), tensor.data = ...): the graph of {graph} would keep reading and "
                        "writing the old memory. Change the cache in place (.copy_()), or call runner.reset() "
                        "after reallocating the cache"
                    )
                _refuse_other_cache(graph, f"tensor {index} of {len(then)} differs", len(now))
            if given is not captured and _layout(given) != _layout(captured):
                raise InputError(
                    f"past_key_values tensor {index} of {len(then)} is another tensor over the memory the graph "
                    f"of {graph} captured, in another layout (shape, strides, dtype {_layout(given)}, captured "
                    f"{_layout(captured)}): the graph would keep reading it in the captured layout. Pass the "
                    "cache tensors in the layout they had at capture, or call runner.reset()"
                )
        if len(now) != len(then):
            _refuse_other_cache(graph, f"{len(then)} tensors captured", len(now))


def _layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype


def _refuse_other_cache(graph: str, which: str, given: int) -> None:
    raise InputError(
        f"past_key_values are not the tensors the graph of {graph} captured ({which}; {given} given): "
        "the graph would keep reading and writing the old cache. Call runner.reset() after reallocating "
        "or replacing any KV-cache tensor"
    )


# const_data_ptr reads the address without materialising a copy-on-write
# tensor; torch builds without it (none in the supported range, 2.5+, that we
# know of) fall back to data_ptr.
_data_ptr = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)
_UNSEEN = object()


def cache_flattener(past_key_values: KVCache) -> Callable[[Any], list[Any]]:
    """How to list a KV cache's tensors in order, chosen once at capture: the
    usual list of (key, value) pairs is chained, a fraction of the cost of a
    general tree flatten. A later cache of another layout then lists other
    objects (or fails to chain), and is refused all the same."""
    if type(past_key_values) in _SEQUENCES and all(type(layer) in _SEQUENCES for layer in past_key_values):
        return _chained
    return _tree_leaves


def _chained(past_key_values: KVCache) -> list[Any]:
    try:
        return list(itertools.chain.from_iterable(past_key_values))
    except TypeError:  # not a sequence of sequences any more
        return [past_key_values]


def _tree_leaves(past_key_values: KVCache) -> list[Any]:
    return tree_flatten(past_key_values)[0]


_SEQUENCES = (list, tuple)
_MUTABLE = (list, dict, set, collections.deque)


class FrozenExtras(dict):
    """The extra inputs a graph captured by reference (those without a
    buffer), by name, and what the mutable containers among them (a dict of
    per-step settings, a list) held at capture: ``contents``. A graph reads
    the values its capture froze, so a later step must pass the same objects
    holding the same values; an engine that reuses one dict and updates it
    in place passed the identity check while graph steps replayed the old
    values (0.62 off eager, an engine-input hunt, 2026-12-03)."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)
        # By their items alone (an equal list put in place of one inside changes nothing the graph read),
        # without bound: a change past a bound would pass unseen. The objects are kept alive here.
        self._prints = prints = Fingerprints(items=None, container_ids=False)
        self.contents = {name: prints.of(value) for name, value in values.items()
                         if isinstance(value, _MUTABLE) or (isinstance(value, tuple) and _holds_mutable(value))}
        #: The data pointers of each extra's tensors at capture: a graph reads that memory, so new memory
        #: under the same object (``t.data = new``, ``t.set_(new)``) would be silently ignored.
        self.pointers = {name: pointers for name, value in values.items() if (pointers := tensor_pointers(value))}

    @staticmethod
    def fingerprint(value: Any) -> Any:
        """What an extra input holds, as :attr:`contents` has it (``graphmode.checks.fingerprints``)."""
        return Fingerprints(items=None, container_ids=False).of(value)


def tensor_pointers(value: Any) -> tuple[int, ...]:
    """The data pointers of the tensors in ``value`` (itself, or its leaves), in order."""
    leaves = [value] if isinstance(value, torch.Tensor) else \
        tree_flatten(value)[0] if isinstance(value, (list, tuple, dict)) else []
    return tuple(pointer for leaf in leaves if (pointer := _pointer(leaf)) is not None)


def _pointer(leaf: Any) -> int | None:
    """A strided tensor's data pointer; None for anything else (a sparse tensor, a wrapper without storage)."""
    if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
        return None
    try:
        return int(_data_ptr(leaf))
    except RuntimeError:
        return None


def _holds_mutable(value: tuple) -> bool:
    return any(isinstance(item, _MUTABLE) or (isinstance(item, tuple) and _holds_mutable(item)) for item in value)


def check_same_objects(captured: Captured, inputs: StepInputs) -> None:
    """A graph reads what it captured: a KV cache at other addresses, or a
    changed extra input without a buffer, would be silently ignored, so
    refuse it."""
    captured.memory.check(inputs.past_key_values, captured.name)
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
        for name, then in getattr(captured.extras, "contents", {}).items():
            if FrozenExtras.fingerprint(given[name]) != then:
                raise InputError(
                    f"extra model input {name!r} is the object the graph of {captured.name} captured, but what it "
                    f"holds changed since (now {_shown(given[name])}): graphs freeze extra inputs that have no buffer, "
                    "so graph steps would go on reading the values of the capture. Keep its contents fixed and pass "
                    "a new object when they change (the graph is then refused, naming it), declare a tensor that "
                    "changes as a step input (build_graph_runner(step_inputs=[BufferSpec(...)])), or a host value "
                    f"that picks the graph as a graph variant (graph_variants={{{name!r}: (...)}})"
                )
        for name, pointers in getattr(captured.extras, "pointers", {}).items():
            if tensor_pointers(given[name]) != pointers:
                raise InputError(
                    f"extra model input {name!r} is the object the graph of {captured.name} captured, but its "
                    f"tensor memory moved (data_ptr {_shown_pointers(tensor_pointers(given[name]))}, captured at "
                    f"{_shown_pointers(pointers)}: tensor.data = ..., tensor.set_(...)): the graph would go on reading "
                    "the memory of the capture. Change it in place (.copy_()), call runner.reset() after "
                    "reallocating it, or declare it as a step input "
                    "(build_graph_runner(step_inputs=[BufferSpec(...)])) so that every step's value is copied in"
                )


def _shown_pointers(pointers: tuple[int, ...]) -> str:
    return ", ".join(f"{p:#x}" for p in pointers) or "none"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_other_extras(captured: Captured, given: list[str]) -> None:
    """A step passing other undeclared extra inputs (by name) than the graph captured."""
    then = sorted(captured.extras)
    new, missing = sorted(set(given) - set(then)), sorted(set(then) - set(given))
    differs = " (this step " + ", ".join(([f"adds {new}"] if new else []) + ([f"lacks {missing}"] if missing else [])) + ")"
    if captured.in_warmup:
        fix = (
            "runner.warmup() captures with the extras given to it: pass the ones the steps pass, "
            "runner.warmup(past_key_values, " + ", ".join(f"{n}=..." for n in given) + ")"
        )
    else:
        name = (new or missing)[0]
        fix = (
            "Pass the same extra inputs at every step, or declare one whose value changes: a tensor as a step "
            f"input (build_graph_runner(step_inputs=[BufferSpec({name!r}, ...)]), a host value that picks "
            f"the graph as a graph variant (graph_variants={{{name!r}: (...)}}); or call runner.reset() to "
            "capture again"
        )
    raise InputError(
        f"this step passes extra model inputs {given}, but the graph of {captured.name} was captured "
        f"with {then}{' (by warmup())' if captured.in_warmup else ''}{differs}: graphs freeze extra inputs. {fix}"
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
        self._expected_layers: int | None = None  # the top-level entries of the model's own cache, a list
        self._last: Any = _UNSEEN
        self._last_leaves: list[Any] = []

    def __call__(self, past_key_values: KVCache) -> None:
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

    def recheck(self, past_key_values: KVCache) -> None:
        """Check the cache as if its container had not been seen: before a
        capture, which freezes the tensors an engine may have replaced inside
        a container seen before (``cache[i] = (k, v)``), which a step's check
        passes on its identity. Tensors seen before pass on theirs."""
        self._last = _UNSEEN
        self(past_key_values)

    def forget(self) -> None:
        """Drop the last cache seen (``runner.reset()``): an engine
        reallocating its cache frees the old one before making the new."""
        self._last, self._last_leaves = _UNSEEN, []

    def _check(self, past_key_values: KVCache, leaves: list[Any]) -> None:
        # The shapes against the model's first, block size aside, then the block size: a cache in another
        # layout (its KV heads where the block size belongs) is a layout error, not a block size to build with.
        self._check_against_model(past_key_values, leaves)
        check_cache_layout(self.model, leaves, self.block_size)

    def _check_against_model(self, past_key_values: KVCache, leaves: list[Any]) -> None:
        expected = self._reference()
        if expected is None:
            return
        # The layers of the model's own cache, not len(model.layers): a model sharing KV across layers makes
        # fewer than it has, and `layers` may be anything (a count).
        layers = self._expected_layers
        if layers is not None and isinstance(past_key_values, (list, tuple)) and len(past_key_values) != layers:
            raise InputError(
                f"past_key_values has {len(past_key_values)} layers, but the model's make_kv_cache gives {layers}: "
                "the missing layers would be skipped (or the extra ones ignored) silently. Make the cache with "
                "model.make_kv_cache(num_cache_blocks, block_size)"
            )
        if len(leaves) != len(expected):
            raise InputError(
                f"past_key_values holds {len(leaves)} tensors, but the model's make_kv_cache gives "
                f"{len(expected)}; make the cache with model.make_kv_cache(num_cache_blocks, block_size)"
            )
        assert self.geometry is not None  # _reference() gives tensors only with it
        blocks, block_size = self.geometry.blocks_dim, self.geometry.block_size_dim
        for index, (tensor, want) in enumerate(zip(leaves, expected)):
            if not isinstance(tensor, torch.Tensor):
                continue
            shape, wanted = list(tensor.shape), list(want.shape)
            if len(shape) == len(wanted):
                shape[blocks] = wanted[blocks] = shape[block_size] = wanted[block_size] = -1
            if shape != wanted:
                raise InputError(
                    f"KV-cache tensor {index} has shape {tuple(tensor.shape)}, but the model's make_kv_cache "
                    f"gives {tuple(want.shape)} (blocks aside: dimension {blocks} is the block count, "
                    f"{block_size} the block size) in the "
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
        """The tensors of a 2-block cache of the model's: on ``meta`` (no
        memory) when its ``make_kv_cache`` takes ``device=``, else where it
        makes them (a model's own ``make_kv_cache(num_cache_blocks,
        block_size)`` need not take a device)."""
        if self._expected is None:
            make = getattr(self.model, "make_kv_cache", None)
            if make is None or self.geometry is None:
                return None
            where = {"device": "meta"} if _takes_device(make) else {}
            made = make(2, self.block_size, **where)
            self._expected = tree_flatten(made)[0]
            self._expected_layers = len(made) if isinstance(made, (list, tuple)) else None
        return self._expected


def _takes_device(make: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):  # no signature to read: ask for meta, as before
        return True
    return any(p.name == "device" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _leaves(past_key_values: KVCache) -> list[Any]:
    """The cache's tensors in order; a list of (key, value) pairs without a
    general tree flatten (a fraction of its cost)."""
    if isinstance(past_key_values, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in past_key_values):
        return [t for pair in past_key_values for t in pair]
    return tree_flatten(past_key_values)[0]


def check_warmup_cache(graphs: list[Any], past_key_values: KVCache, doing: str = "warmup()") -> None:
    """The cache given to ``runner.warmup()``, or to a step about to capture a
    graph (``doing`` says which, as errors name it; the runner checked that it
    fits the model), is the cache the runner's graphs (every family's)
    captured, if any: otherwise the runner would hold graphs on two caches,
    and steps on either would be refused. The same cache as a replay takes
    it (``CacheMemory``): the captured objects at their captured addresses,
    or new tensors over that memory in the captured layout (views an engine
    makes each step)."""
    now = _leaves(past_key_values)
    for captured in graphs:
        problem = _other_cache(now, captured.cache_tensors, captured.memory.pointers)
        if problem is not None:
            raise InputError(
                f"{doing} with another KV cache than the runner's graphs captured (the graph of {captured.name} holds "
                f"other memory: {problem}): the runner would hold graphs on two caches. Pass the cache the graphs "
                "captured (change its tensors in place, .copy_(), rather than replace or reallocate them; new views "
                "of the same memory in the same layout pass), or call runner.reset() first (after reallocating or "
                "replacing any KV-cache tensor)"
            )


def _other_cache(now: list[Any], then: list[Any], pointers: list[Any]) -> str | None:
    """How cache leaves ``now`` differ from the captured ``then`` (at
    ``pointers``), or None where a graph reads them right."""
    if len(now) != len(then):
        return f"{len(then)} tensors captured, {len(now)} given"
    for index, (given, held, pointer) in enumerate(zip(now, then, pointers)):
        if not isinstance(held, torch.Tensor) or not isinstance(given, torch.Tensor):
            if given is not held:
                return f"tensor {index} of {len(then)} differs"
        elif _data_ptr(given) != pointer:
            return (f"tensor {index} of {len(then)} is at {_data_ptr(given):#x}, captured at {pointer:#x}"
                    + (" under the same tensor object (tensor.set_(...), tensor.data = ...)" if given is held else ""))
        elif given is not held and _layout(given) != _layout(held):
            return f"tensor {index} of {len(then)} is in another layout ({_layout(given)}, captured {_layout(held)})"
    return None
