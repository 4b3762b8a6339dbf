"""Configurations of the reference Llama-style model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype = torch.float32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def tiny(cls, dtype: torch.dtype = torch.float32) -> ModelConfig:
        """Small enough for CPU tests: 2 layers, hidden 64."""
        return cls(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=256,
            dtype=dtype,
        )

    @classmethod
    def bench(cls, dtype: torch.dtype = torch.bfloat16) -> ModelConfig:
        """The benchmark model: a 0.5B Qwen2-sized decoder."""
        return cls(
            num_hidden_layers=24,
            hidden_size=896,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=32000,
            dtype=dtype,
        )
