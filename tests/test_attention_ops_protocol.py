"""The AttentionOps protocol names everything graphmode calls on a vendor's
kernels, and every vendor's ops implement it with its signatures.

Ops that record every attribute read run through the runner (capture,
replay, warm-up, debug mode), piecewise graphs and the conformance harness:
what they read must be exactly the protocol's members."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from plugins import walkthrough
from test_hookspecs import harness, variant

import graphmode
from graphmode.attention import AttentionOps
from graphmode.plugins.manager import installed_vendor_names

PROTOCOL = {name for name in vars(AttentionOps) if not name.startswith("_")} | set(AttentionOps.__annotations__)


class Recording:
    """Attention ops that note the name of every attribute read through them."""

    def __init__(self, ops: Any, used: set[str]) -> None:
        self.__dict__.update(_ops=ops, _used=used)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            self._used.add(name)
        return getattr(self._ops, name)


def test_the_protocol_names_what_graphmode_calls_and_nothing_else():
    used: set[str] = set()

    @graphmode.hookimpl
    def recorded_ops():
        return Recording(walkthrough.AcmeAttentionOps(), used)

    vendor = graphmode.load_vendor("acme", plugin=variant(walkthrough, "acme", graphmode_attention_ops=recorded_ops))
    graphs = harness(vendor, max_batches=12, debug=True)
    graphs.runner.warmup(graphs.graph_cache, progress=False)
    seqs = graphs.start(5)  # prefill, eager
    for batch in (5, 5, 3):
        graphs.step(seqs[:batch])  # replays, checked slot by slot through block_view
    pieces = harness(vendor, max_batches=12, execute_mode="piecewise")
    seqs = pieces.start(3)
    pieces.step(seqs)
    assert pieces.runner.stats.piecewise_captures >= 1
    extra = sorted(used - PROTOCOL)
    assert not extra, (
        f"graphmode read {extra} from the vendor's attention ops, which graphmode.attention.AttentionOps "
        "does not name: add them to the protocol and to docs/writing-a-plugin.md"
    )
    assert used == PROTOCOL, f"AttentionOps names {sorted(PROTOCOL - used)}, which nothing here reads"


VENDOR_OPS = {name: lambda name=name: graphmode.load_vendor(name).attention_ops() for name in installed_vendor_names()}
VENDOR_OPS["walkthrough"] = walkthrough.AcmeAttentionOps


@pytest.mark.parametrize("name", sorted(VENDOR_OPS))
def test_every_vendor_s_ops_implement_the_protocol(name):
    ops = VENDOR_OPS[name]()
    assert isinstance(ops, AttentionOps), f"{type(ops).__name__} lacks {sorted(n for n in PROTOCOL if not hasattr(ops, n))}"
    for member in sorted(PROTOCOL):
        expected = getattr(AttentionOps, member, None)
        if not callable(expected):
            assert isinstance(getattr(ops, member), str), f"{type(ops).__name__}.{member} is not a str"
            continue
        wanted = list(inspect.signature(expected).parameters)[1:]  # without self
        got = list(inspect.signature(getattr(ops, member)).parameters)
        if member in ("prefill_attention", "paged_decode_attention") and got == [*wanted, "out"]:
            continue  # the optional out= the protocol describes (the CUDA plugin's prefill with Triton)
        assert got == wanted, f"{type(ops).__name__}.{member}{tuple(got)}: the protocol's parameters are {tuple(wanted)}"
    shape = ops.cache_shape(11, 13, 3, 8)
    key, value = ops.make_kv_cache(1, 11, 13, 3, 8, torch.float32, torch.device("cpu"))[0]
    assert key.shape == value.shape == shape
    view = ops.block_view(key, 8)
    assert view.shape == (11, 13, 3, 8) and view.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()
