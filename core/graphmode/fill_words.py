"""One copy kernel for a step's integer buffers.

A fill plan (``graphmode.buffers``) copies each dtype's buffers with one
``_foreach_copy_``: the usual step (int64 ids, positions and slots; int32
block table and lengths) is two copy kernels on a device, each a launch on
the host path. Bytes are bytes: an int64 tensor whose last dimension is
contiguous is, viewed as int32, the same memory with twice the columns, and
copying those words copies the values exactly. :class:`WordCopy` makes the
int64 and int32 groups of a plan one ``_foreach_copy_`` over int32 views:
the destinations and constant sources viewed once, at plan time; each
step's sources viewed as they come. A step whose source has another dtype
than its buffer (an int32 ``input_ids`` for an int64 buffer: the copy
converts) or no contiguous last dimension takes the per-dtype copies instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WordCopy", "word_copy"]

_WIDE, _WORD = torch.int64, torch.int32
# A plan group: (destinations, getters of the first len(getters) destinations' sources, constant sources of the rest).
Group = tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]


class WordCopy:
    """The int64 and int32 groups of a plan, as one copy of int32 words."""

    def __init__(self, destinations: list[torch.Tensor], getters: list[tuple[Any, bool]],
                 constants: list[torch.Tensor]) -> None:
        self.destinations, self.getters, self.constants = destinations, getters, constants

    def run(self, inputs: Any, source: Callable[..., torch.Tensor]) -> bool:
        """Copy the step: ``source(inputs, *getter)`` gives each step source
        (checked as the per-dtype copies check it). False, having copied
        nothing, when a source is not of its buffer's dtype or cannot be
        viewed as words."""
        sources = []
        for getter, wide in self.getters:
            value = source(inputs, *getter)
            if value.dtype is not (_WIDE if wide else _WORD):
                return False
            if wide:
                try:
                    value = value.view(_WORD)
                except RuntimeError:  # no contiguous last dimension
                    return False
            sources.append(value)
        sources.extend(self.constants)
        torch._foreach_copy_(self.destinations, sources)
        return True


def word_copy(groups: list[Group]) -> tuple[WordCopy | None, list[Group]]:
    """The plan's int64 and int32 groups on one device as one
    :class:`WordCopy`, and the groups it leaves; (None, ``groups``) when no
    device has two such groups, or a destination or constant cannot be
    viewed as words."""
    by_device: dict[torch.device, list[Group]] = {}
    for group in groups:
        if group[0] and group[0][0].dtype in (_WIDE, _WORD):
            by_device.setdefault(group[0][0].device, []).append(group)
    # The device's (a host buffer, such as Ascend's host kv lengths, is a group of its own device).
    chosen = next((found for found in by_device.values() if len(found) >= 2), None)
    if chosen is None:
        return None, groups
    step_destinations: list[torch.Tensor] = []
    getters: list[tuple[Any, bool]] = []
    constant_destinations: list[torch.Tensor] = []
    constants: list[torch.Tensor] = []
    try:
        for destinations, group_getters, group_constants in chosen:
            wide = destinations[0].dtype is _WIDE
            count = len(group_getters)
            for destination, getter in zip(destinations[:count], group_getters):
                step_destinations.append(_words(destination))
                getters.append((getter, wide))
            for destination, constant in zip(destinations[count:], group_constants):
                if constant.dtype is not destination.dtype:
                    return None, groups
                constant_destinations.append(_words(destination))
                constants.append(_words(constant))
    except RuntimeError:  # a view without a contiguous last dimension
        return None, groups
    destinations = [*step_destinations, *constant_destinations]
    if not all(t.is_contiguous() for t in (*destinations, *constants)):
        # A copy list holding one strided tensor (a block table narrower than its
        # buffer) loses the fused kernel on a device: keep the per-dtype copies.
        return None, groups
    words = WordCopy(destinations, getters, constants)
    return words, [g for g in groups if not any(g is c for c in chosen)]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_WORD) if tensor.dtype is _WIDE else tensor
