"""The benchmark's workload: the reference model, a KV cache holding random
values, and ready-made decode steps with kv lengths drawn up to the context
length and random block tables (distinct blocks per sequence)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.context import AttnMetadata, StepInputs
from graphmode.kernels import cuda_attention_ops
from graphmode.model import LlamaModel, ModelConfig, build_reference_model
from graphmode.model.parallel import shard_model

__all__ = ["Workload"]


@dataclass
class Workload:
    model: LlamaModel
    kv_cache: list
    device: torch.device
    block_size: int
    width: int
    max_batches: int
    context: int
    vendor: str

    @classmethod
    def build(cls, config: ModelConfig, device: torch.device, *, vendor: str = "cuda", max_batches: int = 256,
              block_size: int = 64, context: int = 1024, steps: int = 64, seed: int = 0,
              process_group: Any = None, attention: str | None = None) -> Workload:
        """The workload; with ``process_group``, the model is this rank's
        tensor-parallel shard (every rank builds the same weights first).
        ``attention`` chooses the CUDA attention kernels (see
        :func:`graphmode.kernels.cuda_attention_ops`); None takes the vendor's."""
        if attention is not None:
            model = build_reference_model(config, device=device, seed=seed, ops=cuda_attention_ops(attention))
        else:
            model = build_reference_model(config, vendor, device, seed=seed)
        if process_group is not None:
            model = shard_model(model, process_group)
        width = -(-(context + steps) // block_size)
        kv_cache = model.make_kv_cache(max_batches * width + 1, block_size)
        generator = torch.Generator(device=device).manual_seed(seed)
        for pair in kv_cache:
            for tensor in pair:
                tensor.normal_(generator=generator)
        return cls(model, kv_cache, device, block_size, width, max_batches, context, vendor)

    def steps(self, batch: int, count: int, seed: int = 1) -> list[StepInputs]:
        """``count`` consecutive decode steps of ``batch`` sequences: every step
        new tokens, kv lengths one longer, the same block tables."""
        rng = random.Random(seed * 1000 + batch)
        blocks = list(range(1, self.max_batches * self.width + 1))
        rng.shuffle(blocks)
        tables = [blocks[i * self.width:(i + 1) * self.width] for i in range(batch)]
        lengths = [rng.randrange(1, self.context - count + 1) for _ in range(batch)]
        device, int32 = self.device, torch.int32
        block_offsets = torch.tensor(tables, dtype=int32, device=device)
        vocab = self.model.config.vocab_size
        steps = []
        for step in range(count):
            positions = [length + step for length in lengths]
            slots = [table[p // self.block_size] * self.block_size + p % self.block_size for table, p in zip(tables, positions)]
            kv = [p + 1 for p in positions]
            attn = AttnMetadata(
                is_decoding=True,
                block_offsets=block_offsets,
                q_start_loc=torch.arange(batch, dtype=int32, device=device),
                q_seqlens=torch.ones(batch, dtype=int32, device=device),
                kv_seqlens=torch.tensor(kv, dtype=int32, device=device),
                kv_start_indices=torch.tensor(slots, dtype=torch.int64, device=device),
                max_q_seq_len=1,
                max_kv_seq_len=max(kv),
                kv_seqlens_cpu=torch.tensor(kv, dtype=int32),
            )
            ids = torch.tensor([[rng.randrange(vocab) for _ in range(batch)]], dtype=torch.int64, device=device)
            pos = torch.tensor([positions], dtype=torch.int64, device=device)
            steps.append(StepInputs(ids, pos, self.kv_cache, attn))
        return steps
