"""The model contract's keywords, checked when a runner is built: every
forward (eager, warm-up, capture) calls ``model(input_ids=...,
position_ids=..., past_key_values=..., attn_metadata=..., **extras)``, so a
forward naming a parameter otherwise (vLLM's ``positions`` and
``kv_caches``) would fail at the first step with a bare TypeError."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from graphmode.errors import ConfigError

__all__ = ["CONTRACT_KEYWORDS", "check_model_signature"]

CONTRACT_KEYWORDS = ("input_ids", "position_ids", "past_key_values", "attn_metadata")


def check_model_signature(model: Any) -> None:
    """Refuse a model whose call cannot take the contract's four keywords,
    naming the missing ones and the parameters it has. A callable without a
    readable signature, or one taking ``**kwargs``, is accepted as is (a module's forward hooks are not
    read)."""
    forward = model.forward if isinstance(model, nn.Module) else model  # a Module's __call__ takes *args, **kwargs
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C extension: nothing to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in CONTRACT_KEYWORDS if name not in named]
    if missing:
        raise ConfigError(
            f"the model's forward takes ({', '.join(_shown(p) for p in parameters)}) but graphmode calls it with the "
            "keywords "
            f"{', '.join(CONTRACT_KEYWORDS)} (docs/engines.md, model contract): {missing} would fail at the first "
            "step. Name the forward's parameters so, or wrap the model: "
            "def forward(self, input_ids, position_ids, past_key_values, attn_metadata, **extras): "
            "return self.model(input_ids, position_ids, past_key_values, attn_metadata, **extras)"
        )


def _shown(parameter: inspect.Parameter) -> str:
    """A parameter as a signature shows it, without its annotation or default (``*args`` for a star)."""
    return ("*" if parameter.kind is inspect.Parameter.VAR_POSITIONAL else "") + parameter.name
