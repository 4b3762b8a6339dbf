"""The model's Python state around a capture: a forward that changes it at
every call (a step counter, a tensor kept from the previous step) is
refused, since a graph replays none of the forward's Python.

A capture runs right after a warm-up forward on the same inputs, so lazy
initialisation (a rotary table grown the first time a longer position
appears, a cache moved to the device once) has happened by then and the
capture changes nothing. A forward that still changes an attribute there
changes it at every call: eager steps would go on changing it, graph steps
would not (the graph keeps reading the tensor it captured, or the number it
froze), and graph output would silently differ from eager output.

Host facts only, once per capture: each module's attributes, its parameters
and buffers included, by identity (numbers and strings by value).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphmode.errors import CaptureError, ReplayError

__all__ = ["EagerRebinds", "ModelState", "watched_rebinds"]

_BY_VALUE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_SHOWN = 4


def _snapshot(model: Any) -> dict[str, tuple[Any, str]]:
    """Every attribute of every module of ``model``: what is compared (the
    value, or the object's id) and how errors name it."""
    modules = model.named_modules() if isinstance(model, nn.Module) else [("", model)]
    state: dict[str, tuple[Any, str]] = {}
    for prefix, module in modules:
        attributes = dict(getattr(module, "__dict__", {}))
        attributes.pop("_modules", None)  # submodules are walked on their own
        for table in ("_parameters", "_buffers"):
            attributes.update(attributes.pop(table, None) or {})
        for name, value in attributes.items():
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(value, _BY_VALUE):
                state[key] = (value, repr(value))
            elif isinstance(value, torch.Tensor):
                state[key] = (id(value), f"tensor {tuple(value.shape)} at {id(value):#x}")
            else:
                state[key] = (id(value), f"{type(value).__name__} at {id(value):#x}")
    return state


def _differs(before: tuple[Any, str] | None, after: tuple[Any, str] | None) -> bool:
    if before is None or after is None:
        return before is not after
    return before[0] is not after[0] and before[0] != after[0]  # a NaN kept is the same object


def _describe(entry: tuple[Any, str] | None) -> str:
    return "absent" if entry is None else entry[1]


class ModelState:
    """The model's attributes before a capture's forward; :meth:`check`
    after it refuses any that the forward rebound or added."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.before = _snapshot(model)

    def check(self, graph: str) -> None:
        after = _snapshot(self.model)
        keys = self.before.keys() | after.keys()
        changed = sorted(key for key in keys if _differs(self.before.get(key), after.get(key)))
        if not changed:
            return
        shown = ", ".join(
            f"{key} ({_describe(self.before.get(key))} -> {_describe(after.get(key))})" for key in changed[:_SHOWN]
        )
        more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
        raise CaptureError(
            f"the model's forward changed its Python state while {graph} was captured, after a warm-up forward "
            f"on the same inputs: {shown}{more}. A graph replays the forward's tensor operations only, so in "
            "graph steps this state would stop changing (a counter stays put, a tensor kept from the previous "
            "step stays the one captured) while eager steps go on changing it: graph output would differ from "
            "eager. Keep such state in a tensor the forward changes in place (state.copy_(new), count.add_(1)), "
            "which graphs replay, pass it each step as a declared step input (step_inputs=), or change it "
            "outside the forward"
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
    cost nothing per step (debug mode checks the addresses at every replay:
    ``param.data = new`` registers nothing). ``graphs_exist()`` says whether
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
        full = held._full if held is not None else None
        if full is not None and full.native is not None:
            full.native.clear()

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
