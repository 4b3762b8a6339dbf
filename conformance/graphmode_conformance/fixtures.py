"""The suite's fixtures, in two layers.

Fixtures a vendor may or must override in its own test class:

- ``vendor``: the :class:`graphmode.Vendor` under test. By default from
  ``--graphmode-vendor`` / ``$GRAPHMODE_VENDOR`` / detection, through the
  pytest plugin ``graphmode_conformance.plugin``.
- ``device``: where graphs run. By default ``--graphmode-device``, else the
  vendor's own device when present, else the CPU emulator.
- ``sizes``: the model and cache sizes (:class:`Sizes`); by default the
  ``--graphmode-*`` size options, else the suite's defaults, sizes left
  open (block size, capture list) taken from the vendor's declarations.
- ``vendor_options``: the vendor's options for every runner the suite
  builds. Through the pytest plugin it is parametrized with the vendor's
  ``GraphSpec.option_variants`` (every test that builds a runner runs under
  each); a class overriding ``vendor`` parametrizes it itself.

Fixtures derived from those, never overridden: ``capabilities``,
``updates_graph_params``, ``build_harness``, ``harness``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

import graphmode
from graphmode_conformance.harness import Harness
from graphmode_conformance.sizes import Sizes, sizes_from_options

__all__ = ["ConformanceFixtures", "VariantsNotRun"]


class VariantsNotRun(UserWarning):
    """A test class runs a vendor that declares option variants under its defaults only."""


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
    def sizes(self, request) -> Sizes:
        return sizes_from_options(request.config)

    @pytest.fixture
    def vendor_options(self, vendor) -> Mapping[str, Any] | None:
        """None: the vendor's defaults (see the module's doc). Reached only
        where nothing parametrized it: a class overriding ``vendor`` of a
        vendor that declares option variants is warned that they do not run."""
        variants = vendor.spec.option_variants
        if variants:
            warnings.warn(
                f"vendor {vendor.name} declares option variants {[dict(v) for v in variants]} "
                "(GraphSpec.option_variants), but this test class overrides the `vendor` fixture and not "
                "`vendor_options`, so its tests run under the vendor's defaults only. To run each variant, add "
                "`@pytest.fixture(params=[dict(v) for v in YOUR_SPEC.option_variants]) def vendor_options(self, "
                "request): return request.param` to the class (docs/conformance.md), or override vendor_options "
                "returning None to mean the defaults only; `graphmode conformance` runs every variant",
                VariantsNotRun,
                stacklevel=1,
            )
        return None

    # -- derived -----------------------------------------------------------

    @pytest.fixture
    def capabilities(self, vendor) -> frozenset[str]:
        return vendor.info.capabilities

    @pytest.fixture
    def updates_graph_params(self, vendor) -> bool:
        """Whether the vendor pushes host values into graphs before replays."""
        return vendor.implements("graphmode_update_graph_params")

    @pytest.fixture
    def build_harness(self, vendor, device, sizes, vendor_options) -> Callable[..., Harness]:
        """``build_harness(cls=Harness, sizes=None, **runner_options)``: a
        harness of the vendor under test at the suite's sizes (or ``sizes``)
        and vendor options."""

        def build(cls: type[Harness] = Harness, sizes: Sizes = sizes, **runner_options: Any) -> Harness:
            return cls.build(vendor, device, sizes, vendor_options=vendor_options, **runner_options)

        return build

    @pytest.fixture
    def harness(self, build_harness) -> Harness:
        return build_harness()


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
