"""The step context's host fields (``kv_seqlens_cpu``): tensors the contract
defines as host copies of device fields (``graphmode.context.HOST_COPIES``).

Two things an engine need not do, done for every step before any hook runs:

- **Mark them on the emulator.** Every tensor there is a CPU tensor, and the
  emulator tells host memory by its mark (``graphmode.emulator.mark_host``);
  a host field is host memory by contract, so an unmarked one is marked. One
  sharing memory with a device field of the step (``kv_seqlens_cpu=kv_seqlens``)
  is replaced by a marked copy instead, so the device field stays device memory.
- **Pass an optional one a vendor reads.** A vendor declares that its kernels
  take a host field as a host buffer sourced from it
  (``BufferSpec(host=True, source="attn_metadata.kv_seqlens_cpu")``: Ascend's
  kv lengths). When a step omits the field, it is derived from its device
  field: free for a step built on the host (that field is host memory
  already), else one device-to-host copy (a synchronisation), counted in
  ``runner.stats.derived_host_copies`` and warned about once, naming the
  field to pass. Before, such a step failed at its first replay, blaming the
  vendor's fill (``ReplayError: graphmode_fill_buffers read a device value
  on the host``), or was refused as missing the buffer's source.
"""

from __future__ import annotations

import warnings

import torch

from graphmode.context import HOST_COPIES, REQUIRED_TENSORS, StepInputs
from graphmode.emulator.host import is_host, mark_host
from graphmode.families.stats import RunnerStats
from graphmode.spec import GraphSpec

__all__ = ["HostFields"]


class HostFields:
    """``complete(inputs, on_host)``: the step with its host fields marked
    (on the emulator) and derived where the vendor reads them (see the
    module docstring); the same object when nothing changes."""

    def __init__(self, spec: GraphSpec, device: torch.device, stats: RunnerStats, vendor: str) -> None:
        # Host field -> the host buffer sourced from it, for those a vendor's kernels read.
        self.read: dict[str, str] = {}
        for buffer in spec.buffers:
            for name in HOST_COPIES:
                if buffer.host and f"attn_metadata.{name}" in buffer.sources:
                    self.read.setdefault(name, buffer.name)
        self.emulated = device.type == "cpu"
        self.stats = stats
        self.vendor = vendor
        self._warned = False

    def complete(self, inputs: StepInputs, on_host: bool) -> StepInputs:
        attn = inputs.attn_metadata
        changes: dict[str, torch.Tensor] = {}
        for name, original in HOST_COPIES.items():
            value = getattr(attn, name)
            if value is None:
                if name in self.read:
                    changes[name] = self._derived(name, getattr(attn, original), on_host)
            elif self.emulated and isinstance(value, torch.Tensor) and not is_host(value):
                if self._aliases_device_field(value, inputs):
                    changes[name] = mark_host(value.clone())
                else:
                    mark_host(value)  # host memory by contract: what the engine would have marked
        if not changes:
            return inputs
        return StepInputs(inputs.input_ids, inputs.position_ids, inputs.past_key_values, attn.replace(**changes),
                          inputs.extras)

    def _derived(self, name: str, original: torch.Tensor, on_host: bool) -> torch.Tensor:
        if on_host:  # a host-built step: its device field is host memory already
            return original
        self.stats.derived_host_copies += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"graphmode: vendor {self.vendor!r} takes attn_metadata.{name} as host values (its host buffer "
                f"{self.read[name]!r}), but this step passes {name}=None: graphmode copies attn_metadata."
                f"{HOST_COPIES[name]} to the host for it, one device-to-host copy (a synchronisation) per step, "
                f"counted in runner.stats.derived_host_copies. Pass attn_metadata.{name}, the host copy of "
                f"{HOST_COPIES[name]} the engine keeps, to save it",
                stacklevel=5,
            )
        if self.emulated:
            return mark_host(original.clone())
        return original.to("cpu")

    @staticmethod
    def _aliases_device_field(value: torch.Tensor, inputs: StepInputs) -> bool:
        """Whether ``value`` shares memory with a device field of the step
        (``kv_seqlens_cpu=kv_seqlens`` on the emulator): marking it would mark that field too."""
        memory = value.untyped_storage().data_ptr()
        attn = inputs.attn_metadata
        fields = (inputs.input_ids, inputs.position_ids, *(getattr(attn, name) for name in REQUIRED_TENSORS))
        return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == memory and not is_host(t)
                   for t in fields)
