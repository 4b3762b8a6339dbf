"""StepDecision: how the runner runs one step, decided once before it runs.

The runner asks its families in order (``GraphFamily.refusal``), and the
first that takes the step names the graph that serves it
(``GraphFamily.graph_for``); or no family takes it, and the last one's reason
says why it runs eagerly. Everything the runner does around a step works on
this one value: tensor-parallel ranks agree on it, debug mode checks the step
against it, the statistics count its tokens, and the family runs it. vLLM's
``BatchDescriptor`` plays the same part (one value that capture and replay
both trust).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphmode.context import StepInputs

if TYPE_CHECKING:
    from graphmode.families.family import GraphFamily

__all__ = ["StepDecision", "decide"]


@dataclass(frozen=True, slots=True)
class StepDecision:
    """One step, as the runner runs it.

    batch, tokens: the step's sequences and tokens. q_len: the new tokens of
    every sequence, or None when they differ. family: the family that runs
    it, or None when it runs eagerly, for ``reason`` (a key of
    ``graphmode.families.stats.EAGER_REASONS``). bucket: the size (in the
    family's unit: sequences or tokens) of the graph that runs it; key: that
    graph's key, as ``GraphFamily.todo`` lists keys. variant: the index of
    the step's graph variant (``graphmode.variants``), which ranks compare."""

    batch: int
    tokens: int
    q_len: int | None
    variant: int
    family: GraphFamily | None = None
    bucket: int | None = None
    key: Any = None
    reason: str | None = None

    @property
    def size(self) -> int:
        """The step's size in its family's unit (sequences, or tokens), which
        ranks agree on beside the bucket; the batch for an eager step."""
        return self.tokens if self.family is not None and self.family.unit == "tokens" else self.batch

    @property
    def padding(self) -> int:
        """The padding tokens its graph computes beside the step's (a padding
        row of a graph of q_len tokens per sequence counts q_len); 0 eagerly."""
        return 0 if self.family is None else self.family.tokens(self.key) - self.tokens


def decide(families: tuple[GraphFamily, ...], inputs: StepInputs, batch: int, q_len: int | None,
           variant: int) -> StepDecision:
    """The first family of ``families`` that takes the step, and its graph;
    else an eager step for the last family's reason ("eager_mode" for none)."""
    reason = "eager_mode"
    for family in families:
        refusal = family.refusal(inputs, batch, q_len)
        if refusal is None:
            bucket, key = family.graph_for(inputs, batch, q_len)
            return StepDecision(batch, inputs.num_tokens, q_len, variant, family, bucket, key)
        reason = refusal
    return StepDecision(batch, inputs.num_tokens, q_len, variant, reason=reason)
