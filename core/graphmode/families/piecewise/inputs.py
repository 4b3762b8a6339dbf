"""The static inputs a piecewise graph's segments read: ``input_ids``,
``position_ids`` and the engine's declared step inputs
(``build_graph_runner(step_inputs=[BufferSpec(...)])``), each one buffer
sized for the largest token bucket and shared by every bucket.

Where the KV writes are captured in the segments, the step's
``kv_start_indices`` too (padding -1: a padding token writes nothing).

A step of ``n`` tokens and ``s`` sequences in token bucket ``b`` writes the
live rows (``n`` per token, ``s`` per sequence) and resets the rows up to
``b`` to the declared padding (ids and positions: 0); the model sees the
first ``b`` rows. A step with a per-sequence input runs here only with one
token per sequence (``PiecewiseGraphs.refusal``), so ``b`` rows hold every
live sequence too.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmode.context import StepInputs
from graphmode.errors import InputError
from graphmode.spec import BufferSpec

__all__ = ["TokenInputs"]


class TokenInputs:
    """The buffers, allocated on first use (from the first step's dtypes)."""

    def __init__(self, max_tokens: int, declared: list[BufferSpec], num_blocks: int, device: torch.device,
                 slots: bool = False) -> None:
        self.max_tokens, self.declared, self.num_blocks, self.device = max_tokens, declared, num_blocks, device
        self.with_slots = slots  # the KV-write slots too, for writes captured in the segments
        self._ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._padding: dict[str, torch.Tensor] = {}

    def fill(self, inputs: StepInputs, bucket: int) -> StepInputs:
        """Copy the step's live rows in, padding up to ``bucket``; the step as
        the segments see it: views of the buffers (``bucket`` rows), the
        step's KV cache, metadata and undeclared extras as they are."""
        if self._ids is None or self._positions is None:
            shape = (1, self.max_tokens)
            self._ids = torch.zeros(shape, dtype=inputs.input_ids.dtype, device=self.device)
            self._positions = torch.zeros(shape, dtype=inputs.position_ids.dtype, device=self.device)
            for spec in self.declared:
                self._padding[spec.name] = spec.allocate(self.max_tokens, self.max_tokens, self.num_blocks, self.device)
                self._buffers[spec.name] = self._padding[spec.name].clone()
        tokens = inputs.num_tokens
        for buffer, values in ((self._ids, inputs.input_ids), (self._positions, inputs.position_ids)):
            buffer[:, :tokens].copy_(values)
            buffer[:, tokens:bucket].zero_()
        if self.with_slots:
            slots = inputs.attn_metadata.kv_start_indices
            if self._slots is None:
                self._slots = torch.full((self.max_tokens, *slots.shape[1:]), -1, dtype=slots.dtype, device=self.device)
            self._slots[:tokens].copy_(slots)
            self._slots[tokens:bucket].fill_(-1)  # a padding token's key and value go nowhere
        extras = dict(inputs.extras)
        for spec in self.declared:
            extras[spec.name] = self._fill_one(spec, inputs.extras.get(spec.name), tokens, inputs.batch_size, bucket)
        return StepInputs(self._ids[:, :bucket], self._positions[:, :bucket], inputs.past_key_values,
                          inputs.attn_metadata, extras)

    def slot_rows(self, bucket: int) -> torch.Tensor:
        """The KV-write slots of the last step filled, ``bucket`` rows (its
        padding rows -1): what a write captured in a segment reads."""
        assert self._slots is not None, "fill() a step first"
        return self._slots[:bucket]

    def _fill_one(self, spec: BufferSpec, value: Any, tokens: int, batch: int, bucket: int) -> torch.Tensor:
        if value is None:
            raise InputError(
                f"step input {spec.name!r} (declared in step_inputs) is missing from this step; a piecewise "
                "graph reads it from its buffer: pass it with every step"
            )
        buffer, padding, dim = self._buffers[spec.name], self._padding[spec.name], spec.row_dim
        live = tokens if spec.per_token else batch
        target = buffer.narrow(dim, 0, live)
        if value.shape != target.shape:
            # A BLOCKS width narrower than the buffer's: the live rows' other
            # columns are padding, not the last step's values.
            target.copy_(padding.narrow(dim, 0, live))
            for index, size in enumerate(value.shape):
                if index != dim and size < target.shape[index]:
                    target = target.narrow(index, 0, size)
        target.copy_(value)
        buffer.narrow(dim, live, bucket - live).copy_(padding.narrow(dim, live, bucket - live))
        return buffer.narrow(dim, 0, bucket)
