"""The capture list is what the vendor declared it would keep.

A vendor declares which batch sizes get a graph: its capture policy
(``GraphSpec.capture_policy``), its largest graph (``max_capture_size``) and,
for hardware that captures only some sizes, ``FixedSizes``. A
``graphmode_capture_sizes`` of its own that drops other sizes (odd sizes,
sizes "too slow" on its hardware, a size above some limit it never
declared) passes the list checks of the hook contract at the suite's
``max_batches``: the list is ascending and ends where it should. But the
batches of a dropped size pad into the next graph, and above the last size
kept they run eagerly, unreported: the header calls the list "the vendor's
policy".

:class:`CapturePolicyTests` asks the hook for its list at several
``max_batches`` (the suite's, and sizes engines run: up to 1024) and
compares it with the declared policy's, size for size; and for a user's
list, that the vendor's keeps the largest size its declarations allow (a
vendor may trim a user's list to a graph budget, which the header reports,
but a list ending lower runs the batches above eagerly).
"""

from __future__ import annotations

from typing import Any

from graphmode.buckets import largest_graph_declaration
from graphmode.errors import ConfigError
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.sizes import Sizes, vendor_capture_sizes
from graphmode_conformance.structure import ConformanceFailure

__all__ = ["CapturePolicyTests", "POLICY_MAX_BATCHES"]

# The max_batches the hook is asked at: small, odd, past each step of the
# graded policy, past a stage of the three-stage one, engine-sized.
POLICY_MAX_BATCHES = (12, 33, 50, 100, 257, 512, 1000, 1024)


def _what_happens(dropped: list[int], kept: list[int]) -> str:
    """What becomes of the batches of the dropped sizes."""
    above = [s for s in dropped if s > kept[-1]]
    inside = [s for s in dropped if s <= kept[-1]]
    said = []
    if inside:
        said.append(f"batches of {_sizes(inside)} pad into the next graph kept")
    if above:
        said.append(f"batches {kept[-1] + 1}..{above[-1]} run eagerly, above the last size kept ({kept[-1]})")
    return " and ".join(said)


def _sizes(sizes: list[int]) -> str:
    return str(sizes) if len(sizes) <= 12 else f"{sizes[:12]} and {len(sizes) - 12} more"


class CapturePolicyTests(ConformanceFixtures):
    def test_capture_list_keeps_what_the_vendor_declared(self, vendor, sizes, vendor_options):
        """With no user's list, the vendor's capture list is its declared
        policy's at every max_batches asked; with a user's list, it ends at
        the largest size the declarations keep of it."""
        spec = vendor.spec
        declared = f"GraphSpec capture_policy={getattr(spec.capture_policy, '__name__', spec.capture_policy)}"
        if spec.max_capture_size is not None:
            declared += f", {largest_graph_declaration(spec.capture_policy, spec.max_capture_size)}={spec.max_capture_size}"
        # The suite's own max_batches first: the header shows its list.
        for top in (sizes.max_batches, *sorted(set(POLICY_MAX_BATCHES) - {sizes.max_batches})):
            asked = Sizes(max_batches=top, table_width=sizes.table_width, block_size=sizes.block_size,
                          dtype=sizes.dtype)
            try:
                got = list(vendor_capture_sizes(vendor, asked, top, vendor_options=vendor_options))
            except ConfigError:
                continue  # a max_batches the vendor refuses (checked by the runner, with its reason)
            wanted = spec.capture_list(top)
            if got == wanted:
                continue
            dropped = [s for s in wanted if s not in got]
            added = [s for s in got if s not in wanted]
            where = (f"[capture list] vendor {vendor.name}: at max_batches={top} with no capture list given, "
                     f"graphmode_capture_sizes returned {_sizes(got)}, but the declarations ({declared}) give "
                     f"{_sizes(wanted)}")
            if dropped:
                raise ConformanceFailure(
                    f"{where}: it drops {_sizes(dropped)}. So {_what_happens(dropped, got)}, unreported: the runner and the suite's "
                    "header call this list the vendor's policy. Hook: graphmode_capture_sizes must return the "
                    "declared list (spec.capture_list(config.max_batches, config.capture_batch_sizes), the "
                    "default); declare what the hardware really captures instead: a policy of its own "
                    "(GraphSpec.capture_policy), max_capture_size=N for a largest graph, FixedSizes((...)) for a "
                    "fixed list"
                )
            raise ConformanceFailure(
                f"{where}: it adds {_sizes(added)}, which the declarations do not promise (the plan, the padding "
                "waste and the header are computed from them). Hook: graphmode_capture_sizes must return the "
                "declared list, or declare the policy it follows in GraphSpec.capture_policy"
            )
        self._given_list_keeps_its_largest(vendor, sizes, vendor_options, declared)

    @staticmethod
    def _given_list_keeps_its_largest(vendor: Any, sizes: Sizes, vendor_options: Any, declared: str) -> None:
        """A user's list (every size up to 48, then steps to 1000): the
        vendor's list may be shorter (a graph budget), never end lower than
        the declarations keep of it."""
        given = tuple(range(1, 49)) + tuple(range(56, 1001, 8))
        for top in (48, 1000):
            user = tuple(s for s in given if s <= top)
            asked = Sizes(max_batches=top, table_width=sizes.table_width, block_size=sizes.block_size,
                          capture_sizes=user, dtype=sizes.dtype)
            try:
                got = list(vendor_capture_sizes(vendor, asked, vendor_options=vendor_options))
            except ConfigError:
                continue
            kept = vendor.spec.capture_list(top, user)
            if got and got[-1] < kept[-1]:
                raise ConformanceFailure(
                    f"[capture list] vendor {vendor.name}: given the capture list {_sizes(list(user))} at "
                    f"max_batches={top}, graphmode_capture_sizes returned {_sizes(got)}, ending at {got[-1]}, but "
                    f"the declarations ({declared}) keep sizes up to {kept[-1]} of it. So batches "
                    f"{got[-1] + 1}..{kept[-1]} run eagerly, which the engine asked graphs for. Hook: "
                    "graphmode_capture_sizes may trim a user's list (a graph budget) but must keep its largest "
                    "size the declarations allow; declare a largest graph (GraphSpec.max_capture_size, "
                    "FixedSizes) if the hardware captures none larger"
                )
