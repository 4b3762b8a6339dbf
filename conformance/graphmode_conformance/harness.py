"""The harness: runs the same decode steps through graphs and eagerly, and
checks each step with messages that say what broke and why.

Graph steps go through the vendor's runner into one KV cache; eager steps go
through the model into another. After every step:

- outputs must match eager (same shape: the live tokens only);
- the graph's cache may only have changed at the slots this step wrote, and
  those must match eager; every other byte, the reserved block's included,
  must be unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import graphmode
from graphmode.context import StepInputs
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

__all__ = ["ConformanceFailure", "Harness", "Sizes"]


class ConformanceFailure(AssertionError):
    """A check failed; the message names the check, the step and a likely cause."""


@dataclass(frozen=True)
class Sizes:
    """The suite's model and cache sizes (fixtures may override them)."""

    max_batches: int = 48
    block_size: int = 16
    table_width: int = 8  # blocks per sequence: 128 tokens of context
    steps: int = 3  # decode steps per batch size

    @property
    def cache_blocks(self) -> int:
        return self.max_batches * self.table_width + 1


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)


@dataclass
class Harness:
    vendor: graphmode.Vendor
    device: torch.device
    sizes: Sizes
    runner: graphmode.GraphRunner
    model: Any
    engine: ReferenceEngine
    graph_cache: list
    eager_cache: list
    check: str = "graph equals eager"
    steps_run: int = 0
    last_capture: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        vendor: graphmode.Vendor,
        device: torch.device,
        sizes: Sizes,
        model_config: ModelConfig | None = None,
        seed: int = 0,
        **runner_options: Any,
    ) -> Harness:
        config = model_config or ModelConfig.tiny()
        model = build_reference_model(config, vendor, device, seed=seed)
        runner = graphmode.GraphRunner(
            model,
            graphmode.RunnerConfig(
                sizes.max_batches, sizes.table_width, sizes.block_size, device,
                num_layers=config.num_hidden_layers, **runner_options,
            ),
            vendor,
        )
        engine = ReferenceEngine(
            sizes.cache_blocks, sizes.block_size, device,
            vocab_size=config.vocab_size, table_width=sizes.table_width, seed=seed + 1,
        )
        return cls(
            vendor, device, sizes, runner, model, engine,
            model.make_kv_cache(sizes.cache_blocks, sizes.block_size),
            model.make_kv_cache(sizes.cache_blocks, sizes.block_size),
        )

    # -- sequences ----------------------------------------------------------

    def start(self, count: int, lengths: list[int] | None = None) -> list[int]:
        """New sequences, prefilled (eagerly) into both caches."""
        seqs = [self.engine.add() for _ in range(count)]
        longest = self.sizes.table_width * self.sizes.block_size // 2
        lengths = lengths or [self.engine.rng.randrange(1, longest) for _ in seqs]
        step = self.engine.prefill(seqs, lengths)
        with torch.inference_mode():
            self.runner(step.input_ids, step.position_ids, self.graph_cache, step.attn_metadata)
            self.model(step.input_ids, step.position_ids, self.eager_cache, step.attn_metadata)
        return seqs

    def finish(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.engine.finish(seq)

    def room(self, seqs: list[int], steps: int) -> bool:
        """Whether every sequence can take ``steps`` more tokens."""
        limit = self.sizes.table_width * self.sizes.block_size
        return all(self.engine.sequences[s].kv_len + steps <= limit for s in seqs)

    # -- one checked step ---------------------------------------------------

    def step(self, seqs: list[int]) -> torch.Tensor:
        """One decode step through graphs and eagerly; raise
        :class:`ConformanceFailure` if they disagree or the cache was hurt."""
        owners = self._block_owners()
        inputs = self.engine.decode(seqs)
        batch = len(seqs)
        bucket = self.runner.bucket_of(batch)
        phase = "replay" if bucket in self.runner.captured_buckets else "capture"
        before = [tuple(t.clone() for t in pair) for pair in self.graph_cache]
        with torch.inference_mode():
            graph = self._call_runner(inputs)
            graph = graph.clone() if isinstance(graph, torch.Tensor) else graph
            eager = self.model(inputs.input_ids, inputs.position_ids, self.eager_cache, inputs.attn_metadata)
        self.steps_run += 1
        where = (
            f"[{self.check}] vendor {self.vendor.name} on {self.device}, batch {batch}, bucket {bucket}, "
            f"step {self.steps_run} ({phase})"
        )
        self._check_outputs(where, graph, eager, seqs, phase)
        self._check_cache(where, before, owners)
        return graph

    def _call_runner(self, inputs: StepInputs) -> Any:
        return self.runner(inputs.input_ids, inputs.position_ids, self.graph_cache, inputs.attn_metadata)

    def _check_outputs(self, where: str, graph: Any, eager: torch.Tensor, seqs: list[int], phase: str) -> None:
        if not isinstance(graph, torch.Tensor) or graph.shape != eager.shape:
            shape = tuple(graph.shape) if isinstance(graph, torch.Tensor) else type(graph).__name__
            fewer = isinstance(graph, torch.Tensor) and graph.dim() == eager.dim() and graph.shape[1] < eager.shape[1]
            cause = (
                "the graph computes fewer tokens than the batch: it was captured at a size other than "
                "its bucket (graphmode_update_context must give the model `bucket` rows)"
                if fewer
                else "outputs not cut to the live tokens (graphmode_get_outputs must slice to num_tokens)"
            )
            raise ConformanceFailure(
                f"{where}: graph output has shape {shape}, eager {tuple(eager.shape)}. Likely cause: {cause}"
            )
        atol, rtol = _tolerance(eager.dtype)
        if torch.allclose(graph, eager, atol=atol, rtol=rtol):
            return
        diff = (graph.float() - eager.float()).abs()
        index = int(diff.argmax())
        token, logit = divmod(index, diff.shape[-1])
        wrong_rows = (diff.amax(dim=-1)[0] > atol + rtol * eager.abs().amax()).nonzero().flatten().tolist()
        if phase == "capture":
            cause = (
                "the forward on the graph's buffers already differs from eager at the capture "
                "step: graphmode_make_buffers, graphmode_fill_buffers or graphmode_update_context "
                "give the model wrong inputs"
            )
        else:
            cause = (
                "the replay used stale inputs: a buffer graphmode_fill_buffers did not refill, a "
                "context field not pointing at its buffer (graphmode_update_context), a host value "
                "frozen at capture (a positive max length, host kv lengths not pushed by "
                "graphmode_update_graph_params), or a graph captured at a size other than its bucket"
            )
        raise ConformanceFailure(
            f"{where}: max |graph - eager| = {diff.max().item():.3g} at token {token} (sequence "
            f"{seqs[token]}), logit {logit}; tolerance atol={atol} rtol={rtol}; wrong tokens: "
            f"{wrong_rows[:8]}{' ...' if len(wrong_rows) > 8 else ''}. Likely cause: {cause}"
        )

    # -- the KV cache -------------------------------------------------------

    def slot_rows(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as (num_slots, values), whatever the vendor's layout."""
        view = self.model.ops.block_view(cache, self.model.config.head_dim)
        return view.reshape(view.shape[0] * view.shape[1], -1)

    def _block_owners(self) -> dict[int, str]:
        owners = {0: "the reserved block 0"}
        for seq in self.engine.sequences.values():
            for block in seq.blocks:
                owners[block] = f"block {block} of sequence {seq.seq_id}"
        return owners

    def _check_cache(self, where: str, before: list, owners: dict[int, str]) -> None:
        written = torch.tensor(sorted(set(self.engine.step_slots)), dtype=torch.long, device=self.device)
        atol, rtol = _tolerance(self.model.config.dtype)
        for layer, (old_pair, new_pair, eager_pair) in enumerate(zip(before, self.graph_cache, self.eager_cache)):
            for name, old, new, eager in zip(("key", "value"), old_pair, new_pair, eager_pair):
                old_rows, new_rows = _bits(self.slot_rows(old)), _bits(self.slot_rows(new))
                changed = (old_rows != new_rows).any(dim=1)
                changed[written] = False
                if changed.any():
                    slots = changed.nonzero().flatten().tolist()
                    hurt = []
                    for slot in slots[:4]:
                        block = slot // self.sizes.block_size
                        hurt.append(f"slot {slot}: {owners.get(block, f'free block {block}')}")
                    raise ConformanceFailure(
                        f"{where}: the graph step changed {len(slots)} {name}-cache slots of layer "
                        f"{layer} that no live token of this step writes ({'; '.join(hurt)}). "
                        "Likely cause: a padding slot wrote into the cache (padding slots must be -1), "
                        "or a stale slot index from an earlier, larger batch"
                    )
                graph_rows = self.slot_rows(new)[written].float()
                eager_rows = self.slot_rows(eager)[written].float()
                if not torch.allclose(graph_rows, eager_rows, atol=atol, rtol=rtol):
                    raise ConformanceFailure(
                        f"{where}: the {name} written to layer {layer}'s cache differs from eager by "
                        f"{(graph_rows - eager_rows).abs().max().item():.3g}. Likely cause: stale inputs "
                        "(input ids or positions not refilled) or a wrong slot mapping"
                    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bits, so that byte-for-byte comparison also holds for NaNs."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer)
