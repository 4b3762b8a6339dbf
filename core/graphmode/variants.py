"""Graph variants: discrete states of a step that need graphs of their own.

Engines keep separate graphs for states a graph cannot take as data: LoRA
adapters active or not (a plain step should not run the adapters' matmuls),
microbatching on or off. An engine declares each such key once, with the
values it may take (``build_graph_runner(graph_variants={"lora": (False,
True)})``), and passes the key as a keyword argument of every step
(``runner(..., lora=True)``); the model gets it as it gets any extra input.
The first value of each key is its default, which a step that leaves the
keyword out runs; with every key at its default a step replays the plain
graphs. Every combination of values gets its own graphs in every family
(keyed by bucket, query length or token bucket, and variant), and all of
them share the runner's memory pool, input buffers and output buffers (one
step runs at a time).

A graph freezes the values it captured (they are host values: an ``if`` in
the model decides what it records), which is why each needs its own graph.
The runner passes the model the declared value object itself, so that the
captured-extras identity check (``check_same_objects``) holds at replay.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from graphmode.errors import ConfigError, InputError

__all__ = ["PLAIN", "GraphVariants", "clean_graph_variants", "file_suffix"]

#: How statistics and errors name the variant of every key at its default.
PLAIN = "plain"

Key = tuple[Any, ...]

# Model-contract names a variant keyword cannot take.
_RESERVED = ("input_ids", "position_ids", "past_key_values", "attn_metadata")


def clean_graph_variants(declared: Any, step_inputs: tuple[str, ...]) -> dict[str, tuple[Hashable, ...]]:
    """``{keyword: (default, other values...)}``, checked: keyword names, at
    least one value each, host values (hashable, not tensors), no two equal."""
    if declared is None:
        return {}
    if not isinstance(declared, Mapping):
        raise ConfigError(
            f"graph_variants={declared!r}: give a dict of keyword -> its values, default first, "
            "e.g. graph_variants={'lora': (False, True)}"
        )
    cleaned: dict[str, tuple[Hashable, ...]] = {}
    for name, values in declared.items():
        if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
            raise ConfigError(f"graph_variants key {name!r}: must be a model keyword argument name, not one of {_RESERVED}")
        if name in step_inputs:
            raise ConfigError(
                f"graph_variants key {name!r} is also declared in step_inputs: a step input is copied into a "
                "buffer every step, a variant picks the graph; give them different names"
            )
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ConfigError(f"graph_variants[{name!r}]={values!r}: give a tuple of values, the default first")
        values = tuple(values)
        if not values:
            raise ConfigError(f"graph_variants[{name!r}] is empty: give its values, the default first")
        for value in values:
            if isinstance(value, torch.Tensor) or not isinstance(value, Hashable):
                raise ConfigError(
                    f"graph_variants[{name!r}] has {type(value).__name__} {value!r}: a variant value is a host "
                    "value a graph freezes (a bool, an int, a string), hashable and not a tensor"
                )
        if len(set(values)) != len(values):
            raise ConfigError(f"graph_variants[{name!r}]={values!r} holds equal values (1 == True); list each once")
        cleaned[name] = values
    return cleaned


class GraphVariants:
    """The declared keys of one runner, and what a step's extras make of them.

    key: a tuple of one declared value per keyword, in declared order (the
    empty tuple when none are declared); ``plain`` is every default."""

    def __init__(self, declared: Mapping[str, Sequence[Hashable]]) -> None:
        self.declared = {name: tuple(values) for name, values in declared.items()}
        self.plain: Key = tuple(values[0] for values in self.declared.values())
        self._labels: dict[Key, str] = {}

    def __bool__(self) -> bool:
        return bool(self.declared)

    def label(self, key: Key) -> str:
        """How statistics and graph names name a variant: "plain", or "lora=True"."""
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = PLAIN if key == self.plain else ", ".join(
                f"{name}={value!r}" for name, value in zip(self.declared, key)
            )
        return label

    def index(self, key: Key) -> int:
        """The key as one number (tensor-parallel ranks compare it every
        step): each value's place among its keyword's declared values, in
        mixed radix."""
        number = 0
        for values, value in zip(self.declared.values(), key):
            number = number * len(values) + values.index(value)
        return number

    def key_at(self, index: int) -> Key:
        """The key :meth:`index` numbered ``index``."""
        key: list[Any] = []
        for values in reversed(list(self.declared.values())):
            index, place = divmod(index, len(values))
            key.append(values[place])
        return tuple(reversed(key))

    def of_step(self, extras: dict[str, Any]) -> tuple[dict[str, Any], Key]:
        """The step's extras with every declared keyword set to its declared
        value object (the default where the step left it out), and its key.
        An undeclared value is refused, naming it and the declared ones."""
        extras = dict(extras)
        key = []
        for name, values in self.declared.items():
            value = self._declared_value(name, values, extras.get(name, values[0]))
            extras[name] = value
            key.append(value)
        return extras, tuple(key)

    def key_of(self, named: dict[str, Any], call: str) -> Key:
        """The key a graph lookup names (``runner.graph(8, lora=True)``:
        ``call`` is "runner.graph(8, 1"), the default for the keywords left
        out; an undeclared keyword is refused, not left out."""
        unknown = sorted(set(named) - set(self.declared))
        if unknown:
            raise InputError(f"{call}, {unknown[0]}=...): not a declared graph variant keyword; this runner's "
                             f"are {list(self.declared)}")
        return self.of_step(named)[1]

    def for_warmup(self, extras: dict[str, Any]) -> list[tuple[dict[str, Any], Key]]:
        """The variants ``warmup(**extras)`` captures: every combination of
        the declared values, but only the given value of a keyword passed in
        ``extras``; the plain variant first."""
        choices = [
            (self._declared_value(name, values, extras[name]),) if name in extras else values
            for name, values in self.declared.items()
        ]
        return [({**extras, **dict(zip(self.declared, key))}, key) for key in itertools.product(*choices)]

    @staticmethod
    def _declared_value(name: str, values: tuple[Hashable, ...], value: Any) -> Any:
        """The declared value equal to ``value``, matched as dict keys are
        (``1 == True``: ``lora=1`` is ``lora=True``), else refused."""
        if isinstance(value, torch.Tensor) or not isinstance(value, Hashable):
            what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else f"a {type(value).__name__}, which is not hashable")
            raise InputError(
                f"graph variant {name} is {what}: a variant picks the graph on the host, before the step "
                f"runs, so pass one of the declared host values {values!r} (from the scheduler's host data, "
                "e.g. any(adapters); reading a device tensor's value would synchronise every step)"
            )
        for declared in values:
            if declared == value:
                return declared
        raise InputError(
            f"graph variant {name}={value!r} is not declared: this runner captures graphs for {name} in "
            f"{values!r} only. Pass one of those, or declare the value with the others, "
            f"build_graph_runner(graph_variants={{{name!r}: {(*values, value)!r}}})"
        )


def file_suffix(label: str) -> str:
    """What a debug dump's file name adds for a variant: nothing for the
    plain one, "-lora_True" for "lora=True"."""
    return "" if label == PLAIN else "-" + re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
