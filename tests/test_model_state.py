"""ModelState, the capture's check of the model's Python state, on a plain
module: what it names when a forward changes a container in place, where
its look inside containers stops, and what it accepts (runner-level cases:
tests/test_own_models.py)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from graphmode import CaptureError
from graphmode.checks.model_state import ModelState


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nested = {"a": [torch.zeros(1), {"b": 1}]}
        self.big = list(range(5000))
        self.pair = (1, 2)
        self.nan = float("nan")
        self.inner = nn.Linear(1, 1)
        self.inner.calls = 0


def _check(change, bookkeeping=()) -> str:
    """What the check says of ``change`` applied to a Holder between the snapshot and the check."""
    model = Holder()
    state = ModelState(model, bookkeeping)
    change(model)
    try:
        state.check("the graph")
    except CaptureError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(("change", "named"), [
    (lambda m: m.nested["a"].__setitem__(0, torch.zeros(1)), r"nested\['a'\]\[0\] \(tensor \(1,\) at 0x\w+ -> tensor"),
    (lambda m: m.nested["a"][1].__setitem__("b", 2), r"nested\['a'\]\[1\]\['b'\] \(1 -> 2\)"),
    (lambda m: m.big.append(0), r"big \(list of 5000 at (0x\w+) -> list of 5001 at \1\)"),
    (lambda m: setattr(m, "pair", (1, 3)), r"pair\[1\] \(2 -> 3\)"),
    (lambda m: setattr(m.inner, "calls", 1), r"inner\.calls \(0 -> 1\).*host_bookkeeping=\('inner\.calls',\)"),
], ids=["nested-tensor", "nested-number", "past-the-budget-append", "tuple-value", "submodule-counter"])
def test_a_change_is_named_by_its_attribute_and_item(change, named):
    # Before: the first three went unseen (nested and big kept their
    # identity), and errors named no item.
    message = _check(change)
    assert re.search(named, message), message


@pytest.mark.parametrize("change", [
    lambda m: None,
    lambda m: setattr(m, "pair", (1, 2)),  # rebuilt equal: by value, as numbers are
    lambda m: m.big.__setitem__(4999, -1),  # past the budget: identity and length only (documented)
    lambda m: setattr(m.inner, "calls", 1),  # declared below
], ids=["nothing", "tuple-rebuilt-equal", "past-the-budget-item", "declared-bookkeeping"])
def test_what_the_check_accepts(change):
    assert _check(change, bookkeeping=("inner.*",)) == "accepted"
