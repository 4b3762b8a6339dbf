"""The suite's fixtures, in two layers.

Fixtures a vendor may or must override in its own test class:

- ``vendor``: the :class:`graphmode.Vendor` under test. By default from
  ``--graphmode-vendor`` / ``$GRAPHMODE_VENDOR`` / detection, through the
  pytest plugin ``graphmode_conformance.plugin``.
- ``device``: where graphs run. By default ``--graphmode-device``, else the
  vendor's own device when present, else the CPU emulator.
- ``sizes``: the model and cache sizes (:class:`Sizes`).

Fixtures derived from those, never overridden: ``capabilities``,
``updates_graph_params``, ``harness``.
"""

from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode_conformance.harness import Harness, Sizes

__all__ = ["ConformanceFixtures"]


class ConformanceFixtures:
    # -- may or must be overridden -----------------------------------------

    @pytest.fixture
    def vendor(self, request) -> graphmode.Vendor:
        """The vendor under test."""
        target = _target(request)
        return target.vendor

    @pytest.fixture
    def device(self, request) -> torch.device:
        """The device graphs run on."""
        return _target(request).device

    @pytest.fixture
    def sizes(self) -> Sizes:
        return Sizes()

    # -- derived -----------------------------------------------------------

    @pytest.fixture
    def capabilities(self, vendor) -> frozenset[str]:
        return vendor.info.capabilities

    @pytest.fixture
    def updates_graph_params(self, vendor) -> bool:
        """Whether the vendor pushes host values into graphs before replays."""
        return vendor.implements("graphmode_update_graph_params")

    @pytest.fixture
    def harness(self, vendor, device, sizes) -> Harness:
        return Harness.build(vendor, device, sizes)


def _target(request):
    try:
        return request.getfixturevalue("graphmode_target")
    except pytest.FixtureLookupError:
        raise pytest.UsageError(
            "the conformance suite needs a vendor: run it with the pytest plugin "
            "(`pytest -p graphmode_conformance.plugin --graphmode-vendor NAME`, or "
            "`graphmode conformance`), or override the `vendor` and `device` fixtures "
            "in your test class"
        ) from None
