"""Each declared option variant changes what runs.

A vendor declares the configurations it must work under
(``GraphSpec.option_variants``, Ascend's two update paths), and the suite
runs every test under each. That proves nothing when a hook ignores the
option: a graph class choosing its own update path, a ``make_graph`` reading
a module default instead of ``meta.vendor_options``, a ``check_config``
resolving every path to the same one, attention kernels that never look at
their options. Every variant then passes, and one of them is never what
runs.

:class:`OptionVariantEffectTests` runs the same steps (a capture and two
replays of one bucket) under each variant and compares what ran: the
Python functions called outside torch, pluggy and the standard library
(graphmode's, the vendor's), and on the emulator what the bucket's graph
recorded (its operators, and the host values its kernels read). Two
variants alike in all of it fail, naming the options.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pluggy
import pytest
import torch

import graphmode
import graphmode_conformance
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, Harness
from graphmode_conformance.sizes import MIN_MAX_BATCHES, Sizes
from graphmode_conformance.watched import ProfileWatch, WatchedHarness

__all__ = ["OptionVariantEffectTests", "what_runs"]

# The steps compared: 3 sequences in a bucket of 4 (capture, replay), then 2.
_BUCKET, _BATCH = 4, 3

# Code that is the same whatever the vendor's options: torch's, pluggy's
# (the hook calls themselves), the standard library's (weakref callbacks,
# threading). What is left is graphmode's and the vendor's.
_SHARED_CODE = (
    os.path.dirname(str(torch.__file__)) + os.sep,
    os.path.dirname(str(pluggy.__file__)) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
)

# graphmode's own code (the core, this suite): the rest is the vendor's.
_CORE_CODE = tuple(os.path.dirname(str(module.__file__)) + os.sep for module in (graphmode, graphmode_conformance))


@dataclass(frozen=True)
class WhatRuns:
    """What one option variant ran: the functions called (file, first line,
    name), and per graph what the emulator recorded (None on a device)."""

    functions: frozenset[tuple[str, int, str]]
    graph: tuple[Any, ...] | None

    def differences(self, other: WhatRuns) -> int:
        """How many functions one ran and the other did not, plus one if the
        graphs' records differ."""
        return len(self.functions ^ other.functions) + (self.graph != other.graph)


class _CalledFunctions(ProfileWatch):
    """``with called:`` (reusable) records every Python function called in
    the block outside the shared code, on this thread."""

    def __init__(self) -> None:
        self.functions: set[tuple[str, int, str]] = set()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if not code.co_filename.startswith(_SHARED_CODE):
                self.functions.add((code.co_filename, code.co_firstlineno, code.co_qualname
                                    if hasattr(code, "co_qualname") else code.co_name))



def _graph_records(harness: Harness) -> tuple[Any, ...] | None:
    """What the bucket's emulated graph recorded, or None off the emulator."""
    from graphmode_conformance.unseen import _emulated  # unseen imports the harness too

    captured = harness.runner.graph(_BUCKET)
    graph = _emulated(captured.graph) if captured is not None else None
    if captured is None or graph is None:
        return None
    return (type(captured.graph).__qualname__, graph.num_ops, tuple(map(repr, graph.host_arguments())),
            tuple(map(repr, graph.host_scalars())))


def what_runs(harness: WatchedHarness) -> WhatRuns:
    """The steps compared, run on ``harness``, and what the runner ran in them."""
    seqs = harness.start(_BATCH)
    called = harness.watch = _CalledFunctions()
    for batch in (_BATCH, _BATCH, _BATCH - 1):
        harness.step(seqs[:batch])
    harness.watch = None
    return WhatRuns(frozenset(called.functions), _graph_records(harness))


class OptionVariantEffectTests(ConformanceFixtures):
    def test_each_option_variant_changes_what_runs(self, vendor, device, sizes):
        """Under each of the vendor's declared option variants, a capture and
        two replays of one bucket run other code (graphmode's or the
        vendor's functions), or, on the emulator, record another graph, than
        under every other variant."""
        variants: tuple[Mapping[str, Any], ...] = vendor.spec.option_variants
        if len(variants) < 2:
            pytest.skip(f"the vendor declares {len(variants)} option variant(s) (GraphSpec.option_variants): "
                        "nothing to tell apart")
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=(1, _BUCKET))
        # A run first, so that one-time work (imports, caches, kernels
        # registered on first use) lands in none of the compared records.
        what_runs(self._harness(vendor, device, small, variants[0]))
        ran = []
        for variant in variants:
            harness = self._harness(vendor, device, small, variant)
            ran.append((dict(variant), what_runs(harness), harness.runner.config.vendor_options))
        for index, (first, first_ran, first_options) in enumerate(ran):
            for second, second_ran, second_options in ran[index + 1:]:
                if first_ran.differences(second_ran) == 0:
                    raise ConformanceFailure(
                        _same_code(vendor, device, first, second, first_ran, (first_options, second_options)))

    @staticmethod
    def _harness(vendor: Any, device: torch.device, sizes: Sizes, variant: Mapping[str, Any]) -> WatchedHarness:
        harness = WatchedHarness.build(vendor, device, sizes, vendor_options=variant)
        assert isinstance(harness, WatchedHarness)  # Harness.build makes the class it is called on
        harness.check = "option variants"
        return harness


def _same_code(vendor: Any, device: torch.device, first: dict, second: dict, ran: WhatRuns,
               resolved: tuple[Any, Any]) -> str:
    recorded = "" if ran.graph is None else (
        f", and the graph of bucket {_BUCKET} recorded the same {ran.graph[1]} operators with the same host values")
    own = sorted({name for path, _, name in ran.functions if not path.startswith(_CORE_CODE)})
    named = f" ({', '.join(own[:5])}{', ...' if len(own) > 5 else ''})" if own else ""
    same = f"; graphmode_check_config resolved both to {resolved[0]}" if resolved[0] == resolved[1] else ""
    return (
        f"[option variants] vendor {vendor.name} on {device}: under vendor_options {first} and {second} "
        f"(GraphSpec.option_variants) a capture and two replays of batch {_BATCH} in bucket {_BUCKET} ran the same "
        f"code: the same {len(ran.functions)} functions of graphmode and the vendor, {len(own)} of them the "
        f"vendor's{named}{recorded}{same}. So the option reaches nothing that runs, and one of the declared configurations is never "
        "what runs, though every test passes under both. Likely cause: a hook ignoring the runner's options, a "
        "graph class choosing its own path (from the runtime's version, an environment variable, a default) "
        "instead of the one it is given, graphmode_check_config resolving every variant to the same value, "
        "kernels not reading their options. Hooks: graphmode_make_graph (read meta.vendor_options), "
        "graphmode_check_config, graphmode_attention_ops(options); or drop the variant from option_variants"
    )
