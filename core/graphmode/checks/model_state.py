"""The model's Python state around a capture: a forward that changes it at
every call (a step counter, a tensor kept from the previous step, a list it
appends to) is refused, since a graph replays none of the forward's Python.

A capture runs right after a warm-up forward on the same inputs, so lazy
initialisation (a rotary table grown the first time a longer position
appears, a cache moved to the device once, a dict filled for a new shape)
has happened by then and the capture changes nothing. (A warm-up capture of
a shape the forward ran at before in the process runs none; the families
capture it again after one when this check refuses it.) A forward that still
changes an attribute there changes it at every call: eager steps would go on
changing it, graph steps would not (the graph keeps reading the tensor it
captured, or the number it froze; a list stops growing), and graph output
would silently differ from eager output, or the state silently stop changing.

Host facts only, once per capture (never at a replay): each module's
attributes, its parameters and buffers included. Numbers, strings, tuples
and frozensets by value; tensors and other objects by identity (their own
attributes unseen: a vendor's ops object may keep caches of its own); lists,
dicts, sets and deques by identity and by their items, in place changes
included, down to ``_DEPTH`` levels and ``_ITEMS`` items per attribute
(past that, by identity and length: an append still shows, an element
replaced there does not). Attributes the engine names as host bookkeeping
(``host_bookkeeping=``, fnmatch patterns) are not looked at.
"""

from __future__ import annotations

import collections
import fnmatch
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from graphmode.errors import CaptureError, ReplayError

__all__ = ["EagerRebinds", "ModelState", "watched_rebinds"]

_BY_VALUE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_DEPTH = 4
_ITEMS = 4096
_SHOWN = 4


# Fingerprints, compared with ==: a value by value (numbers, strings);
# (_OBJECT, id) for an object by identity, kept alive by the snapshot so
# that its id cannot pass to an object made meanwhile; (_CONTAINER, type,
# id or None for a tuple or frozenset, length, items) for a container, its
# items' fingerprints in order ((key, value) pairs for a dict, a frozenset
# for a set), None past the bounds. Plain tuples, so that a snapshot of a
# model of a thousand modules (a dozen hook dicts each) stays cheap.
_OBJECT, _CONTAINER = object(), object()
_VALUE_TYPES = frozenset(_BY_VALUE)
_CONTAINER_TYPES = frozenset((list, tuple, dict, collections.OrderedDict, set, frozenset, collections.deque))
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)


class _Snapshot:
    """Fingerprints of every attribute of every module of ``model``, under
    the names errors give them, less those ``bookkeeping`` matches."""

    def __init__(self, model: Any, bookkeeping: Sequence[str]) -> None:
        self.objects: dict[int, Any] = {}  # by id: the objects compared by identity, kept alive
        self.budget = _ITEMS  # items left to look at in the attribute at hand
        skip = re.compile("|".join(fnmatch.translate(pattern) for pattern in bookkeeping)).match if bookkeeping else None
        modules = model.named_modules() if isinstance(model, nn.Module) else [("", model)]
        self.state: dict[str, Any] = {}
        for prefix, module in modules:
            attributes = dict(getattr(module, "__dict__", {}))
            attributes.pop("_modules", None)  # submodules are walked on their own
            for table in ("_parameters", "_buffers"):
                attributes.update(attributes.pop(table, None) or {})
            for name, value in attributes.items():
                key = f"{prefix}.{name}" if prefix else name
                if skip is None or not skip(key):
                    self.budget = _ITEMS
                    self.state[key] = self.of(value, 0)

    def of(self, value: Any, depth: int) -> Any:
        """The fingerprint of ``value``, ``depth`` containers down an attribute."""
        kind = type(value)
        if kind in _VALUE_TYPES:
            return value
        if kind not in _CONTAINER_TYPES and not isinstance(value, _CONTAINERS):
            if isinstance(value, _BY_VALUE):  # an IntEnum, a str subclass
                return value
            self.objects[id(value)] = value
            return (_OBJECT, id(value))
        self.objects[id(value)] = value
        whole = None if isinstance(value, (tuple, frozenset)) else id(value)  # by value, as numbers are
        size = len(value)
        if depth >= _DEPTH or size > self.budget:
            return (_CONTAINER, kind, id(value), size, None)
        self.budget -= size
        items: tuple | frozenset
        if isinstance(value, dict):
            items = tuple((self.of(key, depth + 1), self.of(item, depth + 1)) for key, item in value.items())
        elif isinstance(value, (set, frozenset)):
            items = frozenset(self.of(item, depth + 1) for item in value)
        else:
            items = tuple(self.of(item, depth + 1) for item in value)
        return (_CONTAINER, kind, whole, size, items)

    def describe(self, fingerprint: Any) -> str:
        """A fingerprint as errors show it."""
        if fingerprint is _ABSENT:
            return "absent"
        if isinstance(fingerprint, tuple) and fingerprint[0] is _CONTAINER:
            _, kind, whole, size, _ = fingerprint
            return f"{kind.__name__} of {size}" + (f" at {whole:#x}" if whole is not None else "")
        if isinstance(fingerprint, tuple) and fingerprint[0] is _OBJECT:
            value = self.objects[fingerprint[1]]
            if isinstance(value, torch.Tensor):
                return f"tensor {tuple(value.shape)} at {id(value):#x}"
            return f"{type(value).__name__} at {id(value):#x}"
        text = repr(fingerprint)
        return text if len(text) <= 60 else text[:57] + "..."


_ABSENT = object()  # an attribute missing on one side


def _differs(before: Any, after: Any) -> bool:
    return before is not after and before != after  # a NaN kept is the same object


def _where(key: str, before: Any, after: Any, describe: Callable[[Any], str]) -> tuple[str, Any, Any]:
    """Where in an attribute two fingerprints first differ: the item changed
    in place when a list or dict kept its length (and keys), else the whole."""
    containers = all(isinstance(f, tuple) and f[0] is _CONTAINER for f in (before, after))
    if not containers or before[:4] != after[:4] or not (isinstance(before[4], tuple) and isinstance(after[4], tuple)):
        return key, before, after
    is_dict = issubclass(before[1], dict)
    for index, (old, new) in enumerate(zip(before[4], after[4])):
        if is_dict:
            if _differs(old[0], new[0]):
                break  # another key: the whole dict
            if _differs(old[1], new[1]):
                return _where(f"{key}[{describe(old[0])}]", old[1], new[1], describe)
        elif _differs(old, new):
            return _where(f"{key}[{index}]", old, new, describe)
    return key, before, after


class ModelState:
    """The model's attributes before a capture's forward; :meth:`check`
    after it refuses any that the forward rebound, added, removed or
    changed in place, less the attributes ``bookkeeping`` names (the
    runner's ``host_bookkeeping``: fnmatch patterns of the names errors
    give, ``"calls"``, ``"layers.*.timings"``)."""

    def __init__(self, model: Any, bookkeeping: Sequence[str] = (), before: ModelState | None = None) -> None:
        self.model = model
        self.bookkeeping = tuple(bookkeeping)
        # ``before``: a check that passed, nothing having run the model since: its state is this one's
        # (a snapshot of the bench model's 197 modules costs milliseconds; warm-up takes two per graph).
        reuse = before is not None and before.after is not None and before.model is model \
            and before.bookkeeping == self.bookkeeping
        self.before = before.after if reuse and before is not None and before.after is not None \
            else _Snapshot(model, self.bookkeeping)
        self.after: _Snapshot | None = None  # set by a check that passed

    def check(self, graph: str) -> None:
        after = _Snapshot(self.model, self.bookkeeping)
        old, new = self.before.state, after.state
        changed = sorted(key for key in old.keys() | new.keys() if _differs(old.get(key, _ABSENT), new.get(key, _ABSENT)))
        if not changed:
            self.after = after
            return
        self.before.objects.update(after.objects)  # ids of live objects: one table describes both sides
        describe = self.before.describe
        places = [_where(key, old.get(key, _ABSENT), new.get(key, _ABSENT), describe) for key in changed[:_SHOWN]]
        shown = ", ".join(f"{where} ({describe(was)} -> {describe(now)})" for where, was, now in places)
        more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
        raise CaptureError(
            f"the model's forward changed its Python state while {graph} was captured, after a warm-up forward "
            f"on the same inputs: {shown}{more}. A graph replays the forward's tensor operations only, so in "
            "graph steps this state would stop changing (a counter stays put, a list stops growing, a tensor "
            "kept from the previous step stays the one captured) while eager steps go on changing it: graph "
            "output would differ from eager. Keep such state in a tensor the forward changes in place "
            "(state.copy_(new), count.add_(1)), which graphs replay, pass it each step as a declared step input "
            "(step_inputs=), or change it outside the forward. If it is host bookkeeping no output depends on "
            "(a call counter, a profiling list), declare it so and graph steps will leave it unchanged: "
            f"build_graph_runner(..., host_bookkeeping={tuple(changed[:_SHOWN])!r}{more and ' ...'}), names as "
            "above or fnmatch patterns ('layers.*.calls')"
        )


class EagerRebinds:
    """An eager step's forward, or the engine between steps, giving the
    model other parameter or buffer tensors while graphs exist (a rotary
    table regrown by a long prefill; a weight reload by
    ``load_state_dict(..., assign=True)`` or ``module.weight = Parameter(new)``):
    the graphs keep reading the tensors they captured, so every later graph
    step is refused until ``runner.reset()``. Tensor identities only, around
    eager steps that run while graphs are captured, and PyTorch's global
    parameter and buffer registration hooks for the model's modules, which
    cost nothing per step (``param.data = new`` registers nothing: new memory
    under the same objects is ``graphmode.checks.weight_memory``'s, checked
    at every graph step). ``graphs_exist()`` says whether
    graphs are captured; ``on_change()`` runs when a registration is noted
    (the runner forgets its native replays, which skip :meth:`check`)."""

    def __init__(self, model: Any = None, graphs_exist: Callable[[], bool] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.changed: list[str] = []
        self._graphs_exist = graphs_exist
        self._on_change = on_change
        if isinstance(model, nn.Module) and graphs_exist is not None:
            _watch(model, self)

    def registered(self, name: str) -> None:
        """A registration hook saw ``name`` rebound on the model."""
        if name not in self.changed and self._graphs_exist is not None and self._graphs_exist():
            self.changed.append(name)
            if self._on_change is not None:
                self._on_change()

    def run(self, model: Any, forward: Any, graphs_exist: bool) -> tuple[Any, bool]:
        """``forward()``, and whether it rebound a tensor of ``model`` the graphs may hold."""
        if not graphs_exist or not hasattr(model, "named_buffers"):
            return forward(), False
        before = _tensors(model)
        output = forward()
        after = _tensors(model)
        replaced = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        self.changed += [name for name in replaced if name not in self.changed]  # the hooks may have it
        return output, bool(self.changed)

    def check(self) -> None:
        """Refuse a graph step while graphs hold tensors the model replaced."""
        if self.changed:
            more = f" (and {len(self.changed) - _SHOWN} more)" if len(self.changed) > _SHOWN else ""
            raise ReplayError(
                f"something replaced the model's {', '.join(self.changed[:_SHOWN])}{more} after graphs captured the "
                "old tensors (an eager step's forward: a table regrown in Python, a buffer rebound; or between "
                "steps: a weight reload by load_state_dict(..., assign=True), module.weight = Parameter(new), a "
                "submodule swapped): graph steps would keep reading the old ones, unlike eager steps. Size such "
                "tensors before the first capture (for max_blocks_per_seq * block_size positions) or change them "
                "in place (.copy_(), load_state_dict without assign=True); after replacing them, call "
                "runner.reset()"
            )


def watched_rebinds(runner: Any) -> EagerRebinds:
    """``runner``'s :class:`EagerRebinds`, watching its model's registrations
    while it holds graphs (a weak reference: the hooks never keep it alive)."""
    me = weakref.ref(runner)

    def graphs_exist() -> bool:
        held = me()
        return held is not None and any(family.captured() for family in held.families)

    def forget_native() -> None:  # its memo would replay without EagerRebinds.check
        held = me()
        for family in held.families if held is not None else ():
            family.forget_native()

    return EagerRebinds(runner.model, graphs_exist, forget_native)


def _tensors(model: Any) -> dict[str, int]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: id(tensor) for name, tensor in named}


# module -> [(watcher, the module's name in the watcher's model)]; weak both ways.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref, str]]] = weakref.WeakKeyDictionary()
_HOOKED = False


def _watch(model: nn.Module, rebinds: EagerRebinds) -> None:
    global _HOOKED
    if not _HOOKED:  # once per process: every registration anywhere runs it (a dict lookup)
        torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
        torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
        torch.nn.modules.module.register_module_module_registration_hook(_registered)
        _HOOKED = True
    for prefix, module in model.named_modules(remove_duplicate=False):
        live = [(ref, name) for ref, name in _WATCHED.get(module, []) if ref() is not None]
        _WATCHED[module] = [*live, (weakref.ref(rebinds), prefix)]


def _registered(module: nn.Module, name: str, value: Any) -> None:
    for ref, prefix in _WATCHED.get(module, ()):
        rebinds = ref()
        if rebinds is not None:
            rebinds.registered(f"{prefix}.{name}" if prefix else name)
