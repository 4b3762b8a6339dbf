"""GraphMeta: the sizes every graph buffer is allocated at, and the buffers.

One GraphMeta holds the input buffers shared by every batch bucket; each
captured graph gets a copy of it with its own ``output_buffers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphmode.errors import ConfigError
from graphmode.spec import CUDA_SPEC, GraphSpec

if TYPE_CHECKING:
    from graphmode.buffers import FillPlan
    from graphmode.staging import HostStaging

__all__ = ["GraphMeta"]


@dataclass
class GraphMeta:
    """Static facts of graph mode for one model, plus its fixed buffers.

    max_batchs: (sic, as upstream) the most sequences a graph step can hold;
        per-sequence buffers have this many rows.
    max_tokens: the most new tokens in a graph step, ``max_batchs x
        max_q_len`` (``max_batchs`` when decoding one token per sequence);
        per-token buffers have this length.
    num_blocks: columns of the block-table buffer (the runner's
        ``max_blocks_per_seq``), the most KV blocks one
        sequence may own; a step's block table may be narrower, never wider.
    block_size: tokens per KV-cache block.
    device: where the device buffers live.
    family: the graph family whose graphs this meta serves (its
        ``GraphFamily.name``): "full" (decode steps, per batch bucket), or
        another family's name in the meta it passes to ``graphmode_make_graph``
        and ``graphmode_capture_error`` ("piecewise": ``capture_sizes`` are
        token sizes).
    input_buffers: name -> fixed tensor the captured graphs read every replay.
        Right after ``graphmode_make_buffers`` they hold their padding values.
    padding_buffers: a snapshot of ``input_buffers`` taken right after they
        were made: the neutral value of every element, copied back into the
        rows a step does not use.
    output_buffers: name -> the tensors one captured graph writes its result to.
    spec: the declarations the buffers are made, filled and viewed from: the
        vendor's :class:`graphmode.spec.GraphSpec` plus the engine's step inputs.
    live_buffers: for buffers whose live rows take a constant (``live``), a
        tensor like the buffer holding it.
    q_len_padding: q_len -> name -> the padding of each ``q_len_scaled``
        buffer at that q_len, for q_len 2..max_q_len (q_len 1 is
        ``padding_buffers``); see :func:`graphmode.buffers.q_len_paddings`.
    capture_sizes: the runner's buckets (token buckets for piecewise graphs).
    vendor_options: the vendor's options object (``spec.options``), checked.
    vendor_state: what a plugin keeps at run time across a runner's graphs
        (Ascend: the graphs alive, for its advice); never settings.
    staging: the runner's :class:`graphmode.staging.HostStaging`, or None.
    fill_plans: the fill plans by step shape (input-buffer views and copies), made once
        (slicing a dozen buffers costs more host time per replay than copying
        into them); shared by every graph, so it must hold views of input
        buffers only.
    """

    max_batchs: int
    max_tokens: int
    num_blocks: int
    block_size: int
    device: torch.device
    family: str = "full"
    input_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    padding_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    output_buffers: dict[str, Any] = field(default_factory=dict)
    spec: GraphSpec = CUDA_SPEC
    live_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    q_len_padding: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    capture_sizes: tuple[int, ...] = ()
    vendor_options: Any = None
    vendor_state: dict[str, Any] = field(default_factory=dict)
    staging: HostStaging | None = None
    fill_plans: dict[tuple[Any, ...], FillPlan] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        for name in ("max_batchs", "max_tokens", "num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"GraphMeta.{name}={value!r}: must be a positive integer; "
                    f"pass the engine's {name.replace('batchs', 'batches')} as an int >= 1"
                )
        if self.max_tokens < self.max_batchs:
            raise ConfigError(
                f"GraphMeta.max_tokens={self.max_tokens} is below max_batchs="
                f"{self.max_batchs}: a decode step has at least one token per "
                "sequence; set max_tokens >= max_batchs"
            )

    @property
    def max_batches(self) -> int:
        """``max_batchs`` spelt in English."""
        return self.max_batchs

    @property
    def max_q_len(self) -> int:
        """The most new tokens per sequence of a graph step."""
        return self.max_tokens // self.max_batchs

    @property
    def kv_capacity(self) -> int:
        """The most tokens one sequence's block table can address."""
        return self.num_blocks * self.block_size

    def for_graph(self) -> GraphMeta:
        """A copy sharing the input buffers, with empty output buffers."""
        return dataclasses.replace(self, output_buffers={})
