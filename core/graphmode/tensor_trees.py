"""The tensors in an operator call's arguments, found and mapped fast.

The emulator's capture and replay, the piecewise ghost checks and the memory
meter look at every operator's arguments and outputs (hundreds of thousands
of calls in a conformance run). ``torch.utils._pytree`` does that for any
registered container, and spent a quarter of a CPU conformance run doing it
(cProfile, 2026-12-02). Operator arguments are almost always tensors,
scalars and plain tuples, lists and dicts of them: those are walked here
directly, and anything else (a namedtuple, a ``torch.return_types`` value,
another registered container) by ``_pytree`` itself, so the result is what
``tree_flatten`` and ``tree_map`` would give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["map_tensors", "tensors_in"]

# Leaves that hold no tensor; a plain tuple, list or dict is walked here, any other type goes to _pytree.
_LEAVES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree``, in ``tree_flatten``'s order."""
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(tree: Any, found: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _collect(item, found)
    elif kind is dict:
        for item in tree.values():
            _collect(item, found)
    elif isinstance(tree, torch.Tensor):
        found.append(tree)
    elif not isinstance(tree, _LEAVES):
        found.extend(leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``function(t)`` in place of each tensor ``t``, as
    ``tree_map`` of a function that leaves every other value alone builds it
    (new plain containers, other values as they are)."""
    kind = type(tree)
    if kind is tuple:
        return tuple(map_tensors(function, item) for item in tree)
    if kind is list:
        return [map_tensors(function, item) for item in tree]
    if kind is dict:
        return {key: map_tensors(function, item) for key, item in tree.items()}
    if isinstance(tree, torch.Tensor):
        return function(tree)
    if isinstance(tree, _LEAVES):
        return tree
    return tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)
