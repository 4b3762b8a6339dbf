"""Fingerprints of Python values, compared with ``==``: what the host-state
checks compare before and after (``graphmode.checks.model_state``: the
model's attributes around a capture; ``graphmode.checks.cache_checks``: the
contents of the extra inputs a graph froze).

A fingerprint is a plain tuple, so that two snapshots of a model of a
thousand modules compare in C: a value by value (numbers, strings, dtypes);
``(OBJECT, id)`` for any other object, by identity (a tensor, an ops
object: their own attributes unseen), kept alive by the :class:`Fingerprints`
that made it so that its id cannot pass to an object made meanwhile;
``(CONTAINER, type, id or None, length, items)`` for a list, tuple, dict,
set or deque, its items' fingerprints in order (``(key, value)`` pairs for
a dict, a frozenset for a set), or None for the items past ``DEPTH``
containers down or past the item budget.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["BY_VALUE", "CONTAINER", "DEPTH", "ITEMS", "OBJECT", "Fingerprints"]

#: Compared by value.
BY_VALUE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
#: Containers looked into this many levels down.
DEPTH = 4
#: Items looked at per top-level value (an attribute), by default.
ITEMS = 4096
OBJECT, CONTAINER = object(), object()

_VALUE_TYPES = frozenset(BY_VALUE)
_CONTAINER_TYPES = frozenset((list, tuple, dict, collections.OrderedDict, set, frozenset, collections.deque))
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)


class Fingerprints:
    """Makes fingerprints and keeps alive the objects they name by id.

    budget: items left to look at in the value at hand (:meth:`restart`
    sets it back to ``items`` for the next one); None: no bound.
    container_ids: whether a list, dict, set or deque is also compared by
    identity (the model's state: an attribute rebound to an equal list is a
    change), or by its items alone (a frozen extra input: the graph read the
    values, so an equal replacement inside it changes nothing)."""

    def __init__(self, items: int | None = ITEMS, container_ids: bool = True) -> None:
        self.objects: dict[int, Any] = {}
        self.items = items
        self.budget = items
        self.container_ids = container_ids

    def restart(self) -> None:
        """A new top-level value: the item budget again."""
        self.budget = self.items

    def of(self, value: Any, depth: int = 0) -> Any:
        """The fingerprint of ``value``, ``depth`` containers down a top-level value."""
        kind = type(value)
        if kind in _VALUE_TYPES:
            return value
        if kind not in _CONTAINER_TYPES and not isinstance(value, _CONTAINERS):
            if isinstance(value, BY_VALUE):  # an IntEnum, a str subclass
                return value
            self.objects[id(value)] = value
            return (OBJECT, id(value))
        self.objects[id(value)] = value
        # Tuples and frozensets by value, as numbers are.
        whole = None if not self.container_ids or isinstance(value, (tuple, frozenset)) else id(value)
        size = len(value)
        if depth >= DEPTH or (self.budget is not None and size > self.budget):
            return (CONTAINER, kind, id(value), size, None)
        if self.budget is not None:
            self.budget -= size
        items: tuple | frozenset
        if isinstance(value, dict):
            items = tuple((self.of(key, depth + 1), self.of(item, depth + 1)) for key, item in value.items())
        elif isinstance(value, (set, frozenset)):
            items = frozenset(self.of(item, depth + 1) for item in value)
        else:
            items = tuple(self.of(item, depth + 1) for item in value)
        return (CONTAINER, kind, whole, size, items)

    def describe(self, fingerprint: Any) -> str:
        """A fingerprint (of this object's making) as errors show it."""
        if isinstance(fingerprint, tuple) and fingerprint and fingerprint[0] is CONTAINER:
            _, kind, whole, size, _ = fingerprint
            return f"{kind.__name__} of {size}" + (f" at {whole:#x}" if whole is not None else "")
        if isinstance(fingerprint, tuple) and fingerprint and fingerprint[0] is OBJECT:
            value = self.objects[fingerprint[1]]
            if isinstance(value, torch.Tensor):
                return f"tensor {tuple(value.shape)} at {id(value):#x}"
            return f"{type(value).__name__} at {id(value):#x}"
        text = repr(fingerprint)
        return text if len(text) <= 60 else text[:57] + "..."
