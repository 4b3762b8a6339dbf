"""A tiny reference model, an engine and a runner on the CPU emulator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import graphmode
from graphmode.model import LlamaModel, ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine


@dataclass
class Setup:
    model: LlamaModel
    engine: ReferenceEngine
    graph_cache: list
    eager_cache: list
    runner: graphmode.GraphRunner

    def prefill(self, count: int, lengths: list[int] | None = None) -> list[int]:
        """Add ``count`` sequences and prefill them (eagerly) in both caches."""
        seqs = [self.engine.add() for _ in range(count)]
        lengths = lengths or [self.engine.rng.randrange(1, 24) for _ in seqs]
        step = self.engine.prefill(seqs, lengths)
        with torch.inference_mode():
            self.runner(step.input_ids, step.position_ids, self.graph_cache, step.attn_metadata)
            self.model(step.input_ids, step.position_ids, self.eager_cache, step.attn_metadata)
        return seqs

    def decode(self, seqs: list[int], q_len: int | list[int] = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step (``q_len`` new tokens per sequence) through the
        runner and through the model."""
        step = self.engine.decode(seqs, q_len)
        with torch.inference_mode():
            graph = self.runner(step.input_ids, step.position_ids, self.graph_cache, step.attn_metadata).clone()
            eager = self.model(step.input_ids, step.position_ids, self.eager_cache, step.attn_metadata)
        return graph, eager

    def caches_close(self, atol: float = 1e-5) -> bool:
        return all(
            torch.allclose(g, e, atol=atol, rtol=0)
            for pair_g, pair_e in zip(self.graph_cache, self.eager_cache)
            for g, e in zip(pair_g, pair_e)
        )


def tiny_setup(
    vendor: str = "cuda",
    *,
    max_batches: int = 16,
    block_size: int = 16,
    width: int = 8,
    cache_blocks: int | None = None,
    plugin: Any = None,
    device: str = "cpu",
    host_inputs: bool = False,
    **runner_options: Any,
) -> Setup:
    config = ModelConfig.tiny()
    chosen = graphmode.load_vendor(vendor, plugin=plugin)
    model = build_reference_model(config, chosen, device)
    cache_blocks = cache_blocks or max_batches * width + 1
    engine = ReferenceEngine(
        cache_blocks, block_size, device, vocab_size=config.vocab_size, table_width=width, seed=7, host_inputs=host_inputs
    )
    runner = graphmode.build_graph_runner(
        model, max_batches=max_batches, max_blocks_per_seq=width, block_size=block_size, device=device, vendor=vendor,
        **runner_options,
    ) if plugin is None else graphmode.GraphRunner(
        model,
        graphmode.RunnerConfig(max_batches, width, block_size, torch.device(device), **runner_options),
        chosen,
    )
    return Setup(
        model,
        engine,
        model.make_kv_cache(cache_blocks, block_size),
        model.make_kv_cache(cache_blocks, block_size),
        runner,
    )


def slow_gpu_model() -> Any:
    """A model for ordering tests on a GPU: 200 dependent 512x512 matmuls
    (long enough that the host runs ahead of the device), whose logits are
    each token's input id, so a step shows which ids its graph read."""
    torch.manual_seed(0)
    weight = torch.randn(512, 512, device="cuda") / 512**0.5

    def model(input_ids, position_ids, past_key_values, attn_metadata):
        x = weight[:, :1].T.repeat(input_ids.shape[1], 1) * 0
        for _ in range(200):
            x = torch.tanh(x @ weight)
        return (x.sum(-1, keepdim=True) * 0 + input_ids[0, :, None].float())[None]

    return model

