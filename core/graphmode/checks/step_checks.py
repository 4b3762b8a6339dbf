"""A step's input checks, decided once per step layout.

:func:`graphmode.checks.validate.check_inputs` checks every per-step tensor
(type, dtype, placement, shape against the step's sizes) and the step's host
values (its maxima, the host lengths, the declared step inputs). Steps repeat
their layout: the same shapes, dtypes and devices step after step, only the
values change. :class:`StepChecks` remembers each layout that passed, keyed
by the tensors' (shape, dtype, device) (on the emulator also which are host
memory), and for a step of a layout seen before makes only the checks of the
host values, which change every step, in the same order and with the same
errors as ``check_inputs``. A step of a new layout, or one whose tensors are
not tensors, goes through ``check_inputs`` whole, so its errors are unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

from graphmode.checks.validate import _TENSORS, check_inputs, check_scalars, check_values
from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, StepInputs
from graphmode.emulator.host import is_host

__all__ = ["StepChecks"]

_tensors_of = operator.attrgetter(*_TENSORS)
_layout = operator.attrgetter("shape", "dtype", "device")
_LIMIT = 1024  # layouts remembered; an engine has a few per batch size


class StepChecks:
    """``checks(inputs) -> (batch, on_host)``, as ``check_inputs(inputs, config)``."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self._emulated = config.device.type == "cpu"
        # layout -> (batch, tokens, width, on_host, the most KV tokens its table and the runner address)
        self._passed: dict[Any, tuple[int, int, int, bool, int]] = {}

    def __call__(self, inputs: StepInputs) -> tuple[int, bool]:
        attn = inputs.attn_metadata
        key = self._key(inputs, attn) if type(attn) is AttnMetadata else None
        known = self._passed.get(key) if key is not None else None
        if known is None:
            batch, on_host = check_inputs(inputs, self.config)
            if key is not None:
                if len(self._passed) >= _LIMIT:
                    self._passed.clear()
                width, config = attn.block_offsets.shape[-1], self.config
                limit = min(config.max_blocks_per_seq, width) * config.block_size
                self._passed[key] = (batch, inputs.input_ids.shape[1], width, on_host, limit)
            return batch, on_host
        batch, tokens, width, on_host, limit = known
        q_max, kv_max = attn.max_q_seq_len, attn.max_kv_seq_len
        # The usual decode step (int maxima, one token per sequence, the longest within the
        # table) passes check_scalars, tested here in a line; any other takes it whole.
        if type(q_max) is not int or type(kv_max) is not int or kv_max > limit or q_max != 1 \
                or tokens != batch or not attn.is_decoding:
            check_scalars(attn, self.config, batch, tokens, width)
        if attn.kv_seqlens_cpu is not None or inputs.extras or (on_host and kv_max >= 0):
            check_values(inputs, self.config, batch, tokens, width, on_host)
        return batch, on_host

    def _key(self, inputs: StepInputs, attn: AttnMetadata) -> Any:
        """The step's layout, or None where it has none (a value that is not
        a tensor: ``check_inputs`` says what is wrong with it)."""
        try:
            tensors = _tensors_of(inputs)
            layout = tuple(map(_layout, tensors))
            host = attn.kv_seqlens_cpu
            host_layout = None if host is None else (host.shape, host.dtype, host.device)
        except AttributeError:
            return None
        if self._emulated:  # on the emulator every tensor is a CPU tensor: the host ones are marked
            return layout, host_layout, tuple(map(is_host, tensors))
        return layout, host_layout
