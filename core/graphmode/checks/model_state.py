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
included, down to ``DEPTH`` levels and ``ITEMS`` items per attribute
(``graphmode.checks.fingerprints``)
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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphmode.checks.fingerprints import BY_VALUE, CONTAINER, Fingerprints
from graphmode.errors import CaptureError, ReplayError

if TYPE_CHECKING:
    from graphmode.runner import GraphRunner

__all__ = ["EagerRebinds", "KeptBuffers", "ModelState", "watched_rebinds"]

_SHOWN = 4
_EMPTY_CONTAINER_TYPES = frozenset((list, dict, collections.OrderedDict, set, collections.deque))  # by identity
_VALUE_TYPES = frozenset(BY_VALUE)


class _Snapshot:
    """Fingerprints (``graphmode.checks.fingerprints``) of every attribute
    of every module of ``model``, less those ``bookkeeping`` matches:
    ``modules`` maps each module's prefix to its attributes' fingerprints by
    name (two snapshots compare with one ``==``, in C); :attr:`state` gives
    them under the names errors give."""

    def __init__(self, model: Any, bookkeeping: Sequence[str]) -> None:
        self.prints = prints = Fingerprints()  # ITEMS items per attribute
        skip = re.compile("|".join(fnmatch.translate(pattern) for pattern in bookkeeping)).match if bookkeeping else None
        named = model.named_modules() if isinstance(model, nn.Module) else [("", model)]
        self.modules: dict[str, dict[str, Any]] = {}
        # The bench model's 197 modules hold 3,474 attributes, most of them numbers and empty hook
        # dicts: those are fingerprinted here, without a call, and no name is built until an error
        # needs one (a snapshot cost 7 ms on an H200's host; warm-up takes one per graph).
        objects, of, values, empty_types = prints.objects, prints.of, _VALUE_TYPES, _EMPTY_CONTAINER_TYPES
        for prefix, module in named:
            attributes = dict(getattr(module, "__dict__", {}))
            attributes.pop("_modules", None)  # submodules are walked on their own
            for table in ("_parameters", "_buffers"):
                attributes.update(attributes.pop(table, None) or {})
            fingerprints: dict[str, Any] = {}
            for name, value in attributes.items():
                if skip is not None and skip(f"{prefix}.{name}" if prefix else name):
                    continue
                kind = type(value)
                if kind in values:
                    fingerprints[name] = value
                elif kind in empty_types and not value:
                    objects[id(value)] = value
                    fingerprints[name] = (CONTAINER, kind, id(value), 0, ())
                else:
                    prints.restart()
                    fingerprints[name] = of(value, 0)
            self.modules[prefix] = fingerprints

    @property
    def state(self) -> dict[str, Any]:
        """Every fingerprint under its attribute's full name."""
        return {f"{prefix}.{name}" if prefix else name: fingerprint
                for prefix, fingerprints in self.modules.items() for name, fingerprint in fingerprints.items()}

    def describe(self, fingerprint: Any) -> str:
        """A fingerprint as errors show it."""
        return "absent" if fingerprint is _ABSENT else self.prints.describe(fingerprint)


_ABSENT = object()  # an attribute missing on one side


def _differs(before: Any, after: Any) -> bool:
    return before is not after and before != after  # a NaN kept is the same object


def _where(key: str, before: Any, after: Any, describe: Callable[[Any], str]) -> tuple[str, Any, Any]:
    """Where in an attribute two fingerprints first differ: the item changed
    in place when a list or dict kept its length (and keys), else the whole."""
    containers = all(isinstance(f, tuple) and f[0] is CONTAINER for f in (before, after))
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
        if after.modules == self.before.modules:  # the usual case, compared in C
            self.after = after
            return
        old, new = self.before.state, after.state
        changed = sorted(key for key in old.keys() | new.keys() if _differs(old.get(key, _ABSENT), new.get(key, _ABSENT)))
        if not changed:
            self.after = after
            return
        self.before.prints.objects.update(after.prints.objects)  # ids of live objects: one table describes both sides
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


class KeptBuffers:
    """The model's buffers as they were before a warm-up (``runner.warmup()``,
    ``plan_memory()``, ``wake()``), given back after it where the warm-up's
    steps changed them as a step does: state the forward changes in place at
    every call (``self.steps.add_(1)``, a running statistic, an expert-load
    count), which graphs replay and the docs tell a model to keep so, must
    not count warm-up steps, which serve no tokens. Before, each bucket's
    warm-up forward advanced it, and every later step, graph or eager, was
    off the model's own run.

    Told apart from lazy initialisation (a table filled in place the first
    time the forward meets a shape, which must stay) by who changes it (its
    version counter: no synchronisation): a capture's forward runs right
    after a warm-up forward on the same inputs, so a buffer it changes
    changes at every step, and gets its value from before the warm-up back;
    changes made by warm-up forwards only are kept. The values are kept on
    the host (one copy of every buffer, at the warm-up's start). Inference
    tensors carry no version counter, and buffers on the meta device no
    data: neither is kept (docs/architecture.md says so)."""

    def __init__(self, model: Any) -> None:
        named = getattr(model, "named_buffers", None)
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, buffer in named() if callable(named) else ():
            if isinstance(buffer, torch.Tensor) and not buffer.is_inference() and not buffer.is_meta:
                try:
                    self.buffers.append((buffer, buffer.detach().to("cpu", copy=True)))
                except (RuntimeError, NotImplementedError):  # no storage to copy (a subclass, a fake tensor)
                    continue
        self.after = [buffer._version for buffer, _ in self.buffers]  # after the last warm-up forward
        self.per_step: set[int] = set()

    def _moved_since_forward(self) -> None:
        for index, (buffer, _) in enumerate(self.buffers):
            if buffer._version != self.after[index]:
                self.per_step.add(index)

    def forward_starts(self) -> None:
        """Before a warm-up forward: a buffer changed since the last one was
        changed by a capture (the capture's forward), so at every step."""
        self._moved_since_forward()

    def forward_ran(self) -> None:
        """After a warm-up forward: its changes (lazy initialisation for a
        new shape) are kept."""
        self.after = [buffer._version for buffer, _ in self.buffers]

    def restore(self) -> None:
        """Give back the value from before the warm-up to every buffer a
        capture's forward changed."""
        self._moved_since_forward()
        for index in self.per_step:
            buffer, saved = self.buffers[index]
            with torch.inference_mode(False), torch.no_grad():
                buffer.copy_(saved)


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
                "old tensors (between steps: a weight reload by load_state_dict(..., assign=True), module.weight = "
                "Parameter(new), a submodule swapped; or an eager step's forward: a table regrown in Python, a buffer "
                "rebound): graph steps would keep reading the old ones, unlike eager steps. Call runner.reset() after "
                "replacing them (each bucket captures again at its next step), or keep the tensors: change them in "
                "place (.copy_(), load_state_dict without assign=True), and size a table an eager forward grows "
                "before the first capture (for max_blocks_per_seq * block_size positions)"
            )


def watched_rebinds(runner: GraphRunner) -> EagerRebinds:
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
    watched = _WATCHED.get(module, ())
    if not watched:
        return
    # The same object assigned again is no rebind: CTRL's forward runs `self.pos_encoding =
    # self.pos_encoding.to(device, dtype)` at every call, a no-op .to() (an HF-families hunt, 2026-12-04).
    if any(store.get(name) is value for store in (module._parameters, module._buffers, module._modules)):
        return
    for ref, prefix in watched:
        rebinds = ref()
        if rebinds is not None:
            rebinds.registered(f"{prefix}.{name}" if prefix else name)
