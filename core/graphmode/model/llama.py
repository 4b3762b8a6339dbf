"""A Llama-style decoder with a paged KV cache: the reference model.

RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP. It reads
its attention inputs only through the vendor's :class:`AttentionOps`, so the
same model runs every vendor's kernels and cache layout. Its forward follows
graphmode's model contract: ``input_ids`` and ``position_ids`` of shape
(1, T) in, logits of shape (1, T, vocab) out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphmode.attention import AttentionOps, KVCache
from graphmode.context import AttnMetadata
from graphmode.errors import InputError
from graphmode.model.config import ModelConfig
from graphmode.model.lora import LoraAdapters, lora_rows

__all__ = ["LlamaModel"]


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (T, heads, D) by per-token (T, 1, D/2) angles."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.ops = ops
        self.reduce = _identity  # an all-reduce when tensor parallel
        self.qkv_lora: LoraAdapters | None = None  # set by graphmode.model.lora.add_lora
        self.o_lora: LoraAdapters | None = None

    def forward(self, hidden, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttnMetadata, lora_ids=None):
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora_ids is not None and self.qkv_lora is not None:
            qkv = qkv + self.qkv_lora(hidden, lora_ids)
        q, k, v = qkv.split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = rotate(q.view(tokens, self.heads, self.head_dim), cos, sin)
        k = rotate(k.view(tokens, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        self.ops.fill_kv_cache(k, v, k_cache, v_cache, attn)
        if attn.is_decoding:
            out = self.ops.paged_decode_attention(q, k_cache, v_cache, attn, self.scale)
        else:
            out = self.ops.prefill_attention(q, k_cache, v_cache, attn, self.scale)
        out = out.reshape(tokens, self.heads * self.head_dim)
        projected = self.o_proj(out)
        if lora_ids is not None and self.o_lora is not None:
            projected = projected + self.o_lora(out, lora_ids)
        return self.reduce(projected)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.reduce = _identity  # an all-reduce when tensor parallel

    def forward(self, hidden, cos, sin, kv_cache, attn, lora_ids=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn, lora_ids)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        return hidden + self.reduce(self.down_proj(nn.functional.silu(gate) * up))


def embed(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's first hidden states and rotary angles (cos, sin), from a
    model's ``embed_tokens`` and ``rope_cos`` / ``rope_sin`` tables."""
    positions = position_ids[0]
    cos, sin = model.rope_cos[positions][:, None, :], model.rope_sin[positions][:, None, :]
    return model.embed_tokens(input_ids[0]), cos, sin


class LlamaModel(nn.Module):
    """The reference decoder. ``model.config`` is its :class:`ModelConfig`.
    With adapters (``graphmode.model.lora.add_lora``) its forward takes
    ``lora_ids`` (adapter per sequence or per token, 0: none) and ``lora``
    (whether the adapters run; a graph variant, ``graph_variants={"lora":
    (False, True)}``)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        half = config.head_dim // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.tp_size = 1  # set by graphmode.model.parallel.shard_model
        self.lora_count = 0  # adapters, set by graphmode.model.lora.add_lora

    def init_weights(self, seed: int = 0) -> LlamaModel:
        """Random weights (std 0.02, norms at 1), the same for every device."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        return self

    def make_kv_cache(
        self, num_cache_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> KVCache:
        """A KV cache in the vendor's layout of ``num_cache_blocks`` blocks of
        ``block_size`` tokens, shared by every sequence, block 0 included and
        reserved for padding (not the runner's ``max_blocks_per_seq``, the
        width of one sequence's block table)."""
        config = self.config
        return self.ops.make_kv_cache(
            config.num_hidden_layers,
            num_cache_blocks,
            block_size,
            config.num_key_value_heads // self.tp_size,
            config.head_dim,
            config.dtype,
            torch.device(device) if device is not None else self.embed_tokens.weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache,
        attn_metadata: AttnMetadata,
        lora_ids: torch.Tensor | None = None,
        lora: bool = False,
        **extras: Any,
    ) -> torch.Tensor:
        if len(past_key_values) != len(self.layers):  # zip would skip the missing layers
            raise InputError(
                f"past_key_values has {len(past_key_values)} layers, but the model has {len(self.layers)}; "
                "make the cache with model.make_kv_cache(num_blocks, block_size)"
            )
        hidden, cos, sin = embed(self, input_ids, position_ids)
        rows = self._lora_rows(lora, lora_ids, attn_metadata, hidden.shape[0])
        for layer, kv_cache in zip(self.layers, past_key_values):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata, rows)
        return self.lm_head(self.norm(hidden))[None]

    def _lora_rows(self, lora: bool, lora_ids: torch.Tensor | None, attn: AttnMetadata, tokens: int) -> Any:
        """The adapter ids the layers group tokens by, or None: no adapters run."""
        if not lora:  # the plain graph: lora_ids (if any) unread
            return None
        if not self.lora_count or lora_ids is None:
            raise InputError(
                f"lora=True, but the model has {self.lora_count} adapters and lora_ids is "
                f"{'None' if lora_ids is None else 'given'}: add adapters (graphmode.model.lora.add_lora) and "
                "pass lora_ids, or lora=False"
            )
        return lora_rows(lora_ids, attn, tokens, self.lora_count)
