"""A test vendor, "acme", as a third party would write it from docs/: KV
blocks of 32 tokens, a capture list that is not powers of two
([1, 3, 6, 12, 24, 48] at max_batches 48, its declared policy), a graph
budget that trims a user's capture list to six sizes, and a per-token kernel
input of its own (``slot_blocks``: each new token's cache block) that its
fill-cache kernel reads from ``attn_metadata.vendor_fields``.

``graphmode conformance --device cpu --plugin acme_vendor:plugin`` (run from
tests/) passes it unchanged (tests/test_conformance_cli.py).
"""

from __future__ import annotations

import types

import torch

import graphmode
from graphmode.attention import ReferenceAttentionOps, write_slots
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec

BLOCK_SIZE = 32
POLICY = (1, 3, 6, 12, 24, 48)
GRAPH_BUDGET = 6  # graphs per runner, as a device with few graph resources allows


class AcmeOps(ReferenceAttentionOps):
    """The reference kernels, except that the fill-cache kernel takes each
    token's cache block as an input of its own and rebuilds the slot from it:
    a stale or missing block input writes elsewhere."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.kv_start_indices.reshape(-1)
        blocks = attn.vendor_fields.get("slot_blocks")
        if blocks is None:  # eager steps come straight from the engine
            blocks = _blocks_of(slots)
        rebuilt = torch.where(slots >= 0, blocks.long() * BLOCK_SIZE + slots % BLOCK_SIZE, -1)
        write_slots(k_cache, rebuilt, key)
        write_slots(v_cache, rebuilt, value)


def _blocks_of(slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots >= 0, slots // BLOCK_SIZE, 0)


def _policy(max_batches: int) -> list[int]:
    return [s for s in POLICY if s < max_batches] + [max_batches]


ACME_SPEC = CUDA_SPEC.with_buffers(
    # Computed on the device from the step's slots: no host read.
    BufferSpec("slot_blocks", torch.int32, shape=(TOKENS,), padding=0,
               source=lambda step: _blocks_of(step.attn_metadata.kv_start_indices)),
).replace(block_sizes=(BLOCK_SIZE,), capture_policy=_policy)


def _trim(sizes: list[int]) -> list[int]:
    """At most GRAPH_BUDGET sizes: the smallest, the largest, evenly spaced between."""
    if len(sizes) <= GRAPH_BUDGET:
        return sizes
    step = (len(sizes) - 1) / (GRAPH_BUDGET - 1)
    return sorted({sizes[round(i * step)] for i in range(GRAPH_BUDGET)})


@graphmode.hookimpl
def graphmode_vendor_info():
    return graphmode.VendorInfo("acme", ("cuda",), "acme runtime", None, False, "a test vendor in tests/")


@graphmode.hookimpl
def graphmode_graph_spec():
    return ACME_SPEC


@graphmode.hookimpl
def graphmode_capture_sizes(config, spec):
    if config.capture_batch_sizes is not None:
        return _trim(list(config.capture_batch_sizes))
    return spec.capture_policy(config.max_batches)


@graphmode.hookimpl
def graphmode_attention_ops():
    return AcmeOps()


plugin = types.SimpleNamespace(
    __name__="acme", __version__="0.0.1",
    **{name: value for name, value in dict(globals()).items() if name.startswith("graphmode_")},
)
