"""Random-weight EAGLE / EAGLE-3 draft checkpoints for lmdeploy 0.18's speculative decoding.

    from lmdeploy import PytorchEngineConfig, pipeline  # SpeculativeConfig is in lmdeploy.messages
    save_draft("eagle3", target, draft)                  # target: a Llama from lmdeploy_side_by_side.save_model()
    pipe = pipeline(target, backend_config=PytorchEngineConfig(...), speculative_config=spec_config(draft, 3))

What lmdeploy 0.18 loads (pytorch/configurations/llama.py, models/llama_eagle*.py):
- config.json is a Llama config with ``architectures: ["LlamaForCausalLM"]``; lmdeploy renames it to
  ``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` for the draft (``method.capitalize() + arch``).
- eagle3: exactly 1 layer (``midlayer.*``, q/k/v take 2*hidden), ``fc`` (hidden x 3*target_hidden: the target's
  aux hidden states of layers (2, L//2, L-3)), ``norm``, ``lm_head`` (draft_vocab x hidden), ``d2t`` (draft id ->
  target id offsets, int64) and ``t2d`` (skipped); no ``embed_tokens``: the target's is shared.
- eagle: ``layers.N.*`` (layer 0 without input_layernorm), ``fc`` (hidden x 2*hidden), ``embed_tokens``; no
  lm_head or norm: logits come from the target's lm_head.

``echo=True`` (eagle only) zeroes o_proj and down_proj and makes fc pass the target's hidden state through, so the
draft proposes the last token again ``num_tokens`` times: random targets repeat tokens often, so drafts get
accepted (a random draft's almost never are). Attention still runs and fills the draft's KV cache.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

METHODS = ("eagle", "eagle3")
_MARK = "graphmode_spec_method"  # extra config.json key: the method spec_config() passes


def _layer(prefix: str, cfg: dict[str, Any], in_dim: int, gen: torch.Generator, zero_out: bool,
           input_norm: bool = True) -> dict[str, torch.Tensor]:
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {"self_attn.q_proj.weight": rand(q, in_dim), "self_attn.k_proj.weight": rand(kv, in_dim),
           "self_attn.v_proj.weight": rand(kv, in_dim), "self_attn.o_proj.weight": rand(hidden, q),
           "mlp.gate_proj.weight": rand(inter, hidden), "mlp.up_proj.weight": rand(inter, hidden),
           "mlp.down_proj.weight": rand(hidden, inter), "post_attention_layernorm.weight": torch.ones(hidden)}
    if input_norm:
        out["input_layernorm.weight"] = torch.ones(hidden)
    if zero_out:
        out["self_attn.o_proj.weight"].zero_()
        out["mlp.down_proj.weight"].zero_()
    return {f"{prefix}{name}": value for name, value in out.items()}


def save_draft(method: str, target_path: str, draft_path: str, layers: int = 1, *, echo: bool = False,
               seed: int = 0) -> None:
    """Write a random-weight ``method`` ("eagle3" or "eagle") draft for the Llama at ``target_path`` into
    ``draft_path`` (config.json and model.safetensors, bf16), with the target's sizes and ``layers`` layers
    (eagle3: 1 only). ``echo``: see the module's docstring."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {METHODS}")
    if method == "eagle3" and (layers != 1 or echo):
        raise ValueError("eagle3 drafts have exactly 1 layer (lmdeploy refuses others) and no echo")
    with open(os.path.join(target_path, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"target architectures {cfg.get('architectures')}: lmdeploy's EAGLE drafts are Llama's")
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    cfg.update(num_hidden_layers=layers, tie_word_embeddings=False, **{_MARK: method})
    if method == "eagle3":
        cfg.update(draft_vocab_size=vocab, target_hidden_size=hidden)
        weights = _layer("midlayer.", cfg, 2 * hidden, gen, zero_out=False)
        weights |= {"midlayer.hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
                    "fc.weight": torch.randn(hidden, 3 * hidden, generator=gen) * 0.02,
                    # wide logits, as the target's (save_model scales its lm_head by 5)
                    "lm_head.weight": torch.randn(vocab, hidden, generator=gen) * 0.1,
                    "d2t": torch.zeros(vocab, dtype=torch.int64),  # draft id i -> target id i + d2t[i]
                    "t2d": torch.ones(vocab, dtype=torch.bool)}
    else:
        weights = {"embed_tokens.weight": torch.randn(vocab, hidden, generator=gen) * 0.02}
        fc = torch.randn(hidden, 2 * hidden, generator=gen) * 0.02
        if echo:  # fc(cat(embed, target_hidden)) = target_hidden
            fc = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        weights["fc.weight"] = fc
        for i in range(layers):
            weights |= _layer(f"layers.{i}.", cfg, hidden, gen, zero_out=echo, input_norm=i > 0)
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
    os.makedirs(draft_path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(draft_path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(draft_path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def spec_config(draft_path: str, num_tokens: int = 3, method: str | None = None) -> Any:
    """lmdeploy's ``SpeculativeConfig`` for the draft at ``draft_path`` (method: the one save_draft wrote).

    Pass it beside the engine config: ``pipeline(target_path, backend_config=PytorchEngineConfig(...),
    speculative_config=spec_config(draft_path))``; lmdeploy's CUDA backend then needs FlashAttention-3
    (``flash_attn_interface``) or refuses at start-up."""
    from lmdeploy.messages import SpeculativeConfig

    if method is None:
        with open(os.path.join(draft_path, "config.json")) as f:
            method = json.load(f)[_MARK]
    return SpeculativeConfig(method=method, model=draft_path, num_speculative_tokens=num_tokens)
