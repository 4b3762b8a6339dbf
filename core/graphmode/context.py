"""The step context: what one forward step tells the model's attention.

An engine builds an :class:`AttnMetadata` for every step and passes it to the
model as ``attn_metadata``; graphmode's runner hands the model a copy whose
tensors are the graph's fixed buffers. :class:`StepInputs` bundles all the
arguments of one model call, which is what the hooks receive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch

__all__ = ["BLOCKS", "CONTEXT_DTYPES", "HOST_COPIES", "REQUIRED_TENSORS", "SEQUENCES", "STEP_PATHS", "STEP_TENSORS", "TOKENS", "AttnMetadata",
           "KVCache", "StepInputs", "StepModel"]

# Symbolic dimensions of a step tensor's (and a buffer's) shape (``graphmode.spec`` re-exports them).
TOKENS = "tokens"  # one row per new token: max_tokens rows
SEQUENCES = "sequences"  # one row per sequence: max_batches rows
BLOCKS = "blocks"  # the block table's width: max_blocks_per_seq columns (GraphMeta.num_blocks)


def _shape(*dims: str) -> dict[str, tuple[str, ...]]:
    """The metadata of a per-step tensor field: its symbolic shape. Fields
    with it are the step's tensors (STEP_TENSORS); no list elsewhere."""
    return {"shape": dims}


@dataclass
class AttnMetadata:
    """Attention inputs of one step, for ``batch`` sequences and ``T`` new tokens.

    Tensors live on the model's device unless said otherwise. Integer tensors
    may be int32 or int64.

    is_decoding: a decode step: every sequence adds 1 to ``max_q_seq_len``
        tokens (one in plain decode, ``T == batch``; ``1 + k`` in a
        speculative verify or MTP step). A step whose sequences all add the
        same number (``T == batch x max_q_seq_len``) can replay a graph.
        In any step a row may add none: a padding row (``q_seqlens`` 0, no
        slot; vLLM pads ``seq_lens`` so), which runs and writes nothing.
    block_offsets: (batch, width) the KV-cache block ids of each sequence, in
        order. Block 0 is reserved for padding: an engine never gives it to a
        sequence.
    q_start_loc: (batch,) index of each sequence's first new token.
    q_seqlens: (batch,) new tokens per sequence.
    kv_seqlens: (batch,) tokens in the cache per sequence, this step's included.
    kv_start_indices: (T,) the cache slot (``block * block_size + offset``)
        each new token's key and value are written to; -1 writes nothing.
    max_q_seq_len, max_kv_seq_len: host maxima of the lengths (or upper
        bounds of them), or -1 where the engine does not know them; a bound
        below a length is refused where the host sees it (``kv_seqlens_cpu``,
        a host-built step). A graph freezes host values, so graph contexts pass
        values that hold at every replay: -1 ("derive on the device from the
        length tensors") where the vendor's kernel has that rule (CUDA
        default, Camb), an upper bound where it needs one (PPU: the block
        table's capacity).
    kv_seqlens_cpu: optional host copy of ``kv_seqlens`` for kernels that take
        lengths as host values (Ascend). Engines know the lengths on the host;
        passing them avoids a device-to-host copy per step: when a vendor
        reads it and a step omits it, the runner derives it from
        ``kv_seqlens`` (``graphmode.families.host_fields``). A host tensor by
        contract: on the CPU emulator it counts as host memory unmarked.
    x_active_mask: (T,) bool, False for padding tokens, for MoE dispatch. Set by
        the vendors that need it; None otherwise.
    vendor_fields: further per-step tensors a vendor's own kernels read,
        by name (buffers the vendor declares; see ``graphmode.spec``).
    """

    is_decoding: bool
    block_offsets: torch.Tensor = field(metadata=_shape(SEQUENCES, BLOCKS))
    q_start_loc: torch.Tensor = field(metadata=_shape(SEQUENCES))
    q_seqlens: torch.Tensor = field(metadata=_shape(SEQUENCES))
    kv_seqlens: torch.Tensor = field(metadata=_shape(SEQUENCES))
    kv_start_indices: torch.Tensor = field(metadata=_shape(TOKENS))
    max_q_seq_len: int
    max_kv_seq_len: int
    kv_seqlens_cpu: torch.Tensor | None = field(default=None, metadata={**_shape(SEQUENCES), "host_copy_of": "kv_seqlens"})
    x_active_mask: torch.Tensor | None = field(default=None, metadata={**_shape(TOKENS), "dtype": torch.bool})
    vendor_fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.q_seqlens.shape[0]

    def replace(self, **changes: Any) -> AttnMetadata:
        """A copy with some fields changed (the original is left as is)."""
        return dataclasses.replace(self, **changes)


#: (name, symbolic shape) of every per-step tensor field of AttnMetadata, in order.
STEP_TENSORS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (f.name, f.metadata["shape"]) for f in dataclasses.fields(AttnMetadata) if "shape" in f.metadata
)
#: The per-step tensors every step passes (no default), on the model's device
#: or all on the host: what the runner checks, stages and moves.
REQUIRED_TENSORS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(AttnMetadata) if "shape" in f.metadata and f.default is dataclasses.MISSING
)

#: The step-context fields of one dtype by contract, which a buffer backing one must have
#: (MoE dispatch takes x_active_mask as a bool mask: an int8 0/1 mask passed every comparison of its values).
CONTEXT_DTYPES: dict[str, torch.dtype] = {
    f.name: f.metadata["dtype"] for f in dataclasses.fields(AttnMetadata) if "dtype" in f.metadata
}

#: The host fields of the step context, each the host copy of a device field:
#: host memory by contract (an engine need not mark them on the emulator), and
#: derived from the device field when a vendor reads one a step omits.
HOST_COPIES: dict[str, str] = {
    f.name: f.metadata["host_copy_of"] for f in dataclasses.fields(AttnMetadata) if "host_copy_of" in f.metadata
}

#: Where a step's tensors are found in StepInputs, in order: the ones every
#: step passes (what the runner checks per step layout).
STEP_PATHS: tuple[str, ...] = ("input_ids", "position_ids", *(f"attn_metadata.{name}" for name in REQUIRED_TENSORS))


#: The KV cache a step passes as ``past_key_values``: what the model's
#: ``make_kv_cache`` makes (one (key, value) pair per layer in the reference
#: layout, or the tensors of the vendor's layout), any pytree of tensors. The
#: runner flattens it, checks it against the model and holds its tensors by
#: identity; it never looks into a leaf that is not a tensor.
KVCache: TypeAlias = Any


class StepModel(Protocol):
    """What a runner runs: the engine's model, called with one step's
    keywords (and the engine's extra inputs, where it takes them), returning
    its logits or any pytree of tensors. Everything else the runner reads of
    it is optional (docs/architecture.md, "The model contract": ``ops``,
    ``make_kv_cache``, ``check_runner``, its parameters and buffers)."""

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key_values: KVCache,
                 attn_metadata: AttnMetadata) -> Any: ...


@dataclass
class StepInputs:
    """The arguments of one model forward call.

    ``input_ids`` and ``position_ids`` have shape (1, T): one row holding the
    tokens of every sequence back to back. ``extras`` are further keyword
    arguments passed to the model unchanged.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: KVCache
    attn_metadata: AttnMetadata
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.attn_metadata.batch_size

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[-1]

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model(**kwargs)``."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            past_key_values=self.past_key_values,
            attn_metadata=self.attn_metadata,
            **self.extras,
        )
