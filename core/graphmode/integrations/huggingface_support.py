"""Which Hugging Face models the adapter can run, decided at load.

Two checks, both before the model serves a step:

- :func:`refuse_config`, before any weight is read: a composite config
  (a ``text_config``, or no ``num_hidden_layers``: Gemma 3, Fuyu), a family whose model
  class does not route attention through transformers' attention interface
  (``_supports_attention_backend`` false: Falcon, and in transformers 4.56
  StableLM, GPT-J, Qwen2-MoE; they pick an attention class from their own
  table, which has no entry for graphmode's), and attention logit
  soft-capping (``config.attn_logit_softcapping``).
- :func:`probe`, one forward of one token through the built model with a
  recording attention function (no cache, no kernel): every decoder layer
  must reach the attention function with graphmode's step (a decoder layer
  that does not pass keyword arguments through cannot be served), carry
  ``layer_idx``, call it once (differential attention calls it twice, with
  different values for one cache), pass no soft-capping, sinks or bias as
  its mask, and give keys and values of one head size. It also reads each
  layer's sliding window (the keyword the layer passes, or the module's
  ``sliding_window``, which some families apply through the mask only),
  which the runner's table capacity must not exceed
  (:meth:`Probe.check_table`), nor the length at which a ``longrope`` or
  ``dynamic`` RoPE changes its frequencies (:func:`rope_switch`); and the
  first operator whose output size depends on values (``nonzero`` in
  transformers 4.x's Mixtral and Qwen3-MoE routing) and the first host read
  of device memory (``.tolist()`` in JetMoE's routing, dynamic RoPE's
  comparison), for which graph modes are refused when a runner is built
  (:meth:`Probe.check_graphs`): a capture would fail on them.

Messages name the family, the layer or parameter by name and shape (never
tensor values), the reason and the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmode.emulator.capture import ValueSizedOps
from graphmode.emulator.probes import HostReads
from graphmode.errors import ConfigError

#: What every refusal of a family ends with.
SUPPORTED = "docs/engines.md lists the families that run"

_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("graphmode_hf_probe", default=None)


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def refuse_config(config: Any) -> None:
    """Refuse, from the config alone, a family or feature the adapter cannot
    run (see the module docstring)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    family = getattr(config, "model_type", type(config).__name__)
    try:
        model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(
            f"{family!r} has no causal-LM class in transformers {_version()} (AutoModelForCausalLM does not "
            f"know {type(config).__name__}); the adapter runs decoder-only causal LMs: {SUPPORTED}"
        ) from None
    parts = [name for name in ("text_config", "vision_config", "audio_config") if getattr(config, name, None)]
    if "text_config" in parts or not hasattr(config, "num_hidden_layers"):
        fix = "load a text-only checkpoint of the model, or pass its config.text_config for random weights" \
            if "text_config" in parts else "use a decoder-only causal LM"
        raise ConfigError(
            f"{family!r} is not supported: its config is composite ({', '.join(parts) or 'no num_hidden_layers'}: "
            f"its decoder's settings are a sub-config's), and the adapter runs one decoder-only stack of attention "
            f"layers; {fix}. {SUPPORTED}"
        )
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if kinds:
        raise ConfigError(
            f"{family!r} with layers of type {kinds} (config.layer_types) is not supported: graphmode's paged "
            f"attention computes full causal attention (a sliding window within the table's reach); {SUPPORTED}"
        )
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ConfigError(
            f"{family!r} is not supported: in transformers {_version()}, {model_class.__name__} declares no "
            f"support for registered attention functions (_supports_attention_backend is False): "
            f"{_why_no_backend(model_class)}. Use another family or transformers version; {SUPPORTED}"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        raise ConfigError(
            f"{family!r} with config.attention_chunk_size={chunk} (chunked attention) is not supported: graphmode's "
            f"paged attention computes full causal attention; {SUPPORTED}"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ConfigError(
            f"{family!r} with config.attn_logit_softcapping={softcap} is not supported: graphmode's paged "
            "attention kernels have no logit soft-capping, and attention without it gives other tokens. Use a "
            "model without attention soft-capping (config.final_logit_softcapping, which the model applies to "
            f"its logits, is fine); {SUPPORTED}"
        )


def config_window(config: Any) -> int | None:
    """The sliding window the config declares for some layer, or None:
    ``sliding_window`` (Mistral and most), unless ``use_sliding_window`` is
    False (Qwen2's) or ``layer_types`` has no sliding layer."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    off = getattr(config, "use_sliding_window", True) is False or (types is not None and "sliding_attention" not in types)
    return None if not window or off else int(window)


def rope_switch(config: Any) -> tuple[str, int, str] | None:
    """(rope type, length, config field) of a RoPE whose frequencies change
    once a step's ``max(position_ids) + 1`` passes that length (``longrope``'s
    long factors, ``dynamic``'s rescaling), else None: graphmode's step holds
    every running sequence, so one's length would change another's RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Per layer type ({"full_attention": {...}, ...}) or one for every layer.
    found = [p for p in params.values() if isinstance(p, dict)] or [params]
    for rope in found:
        kind = str(rope.get("rope_type", rope.get("type", "")))
        if kind == "longrope":
            name = "original_max_position_embeddings"
            limit = rope.get(name) or getattr(config, name, None) or config.max_position_embeddings
            return kind, int(limit), name
        if "dynamic" in kind:
            return kind, int(config.max_position_embeddings), "max_position_embeddings"
    return None


def _why_no_backend(model_class: type) -> str:
    """What the family's modeling source shows about its attention: a table
    of attention classes, or the attention interface called without the
    model's keyword arguments."""
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (OSError, TypeError, KeyError):
        return "graphmode's paged attention cannot be plugged in"
    if "ATTENTION_CLASSES[" in source:
        return "its decoder layers pick their attention class from the model's own table (ATTENTION_CLASSES), " \
            "which has no entry for a registered attention function such as graphmode's"
    if "ALL_ATTENTION_FUNCTIONS" in source:
        # Not known to be the cause: some such families pass the keywords on (Qwen3-Next), some do not.
        return "its attention calls transformers' attention interface, but the family does not declare that its " \
            "layers pass the model's keyword arguments on to it (StableLM's, for one, pass none), so graphmode's " \
            "step (the paged KV cache and the step's metadata) may not reach it"
    return "its attention does not call transformers' attention interface, so graphmode's attention cannot be plugged in"


@dataclass
class Call:
    """One attention call seen by the probe."""

    name: str  # the module's name in the model, e.g. "model.layers.0.self_attn"
    cls: str
    layer: int | None
    with_step: bool
    key: tuple[int, ...]
    value: tuple[int, ...]
    window: int | None
    softcap: Any
    sinks: str | None  # "name shape", never values
    causal: bool
    mask: tuple[str, Any] | None = None  # the mask the layer passed: its name and shape, and it (_is_bias)


@dataclass
class Probe:
    """What one forward of the model showed about its attention layers."""

    family: str
    num_layers: int
    names: dict[int, str]
    calls: list[Call] = field(default_factory=list)

    config_window: int | None = None
    rope: tuple[str, int, str] | None = None  # see rope_switch
    value_sized: tuple[str, str] | None = None  # an operator no graph can capture, and where it was called
    host_read: tuple[str, str] | None = None  # a host read of device memory, and where it was called

    @property
    def window(self) -> tuple[int, str] | None:
        """The smallest sliding window of any layer and where it was seen:
        what the layers passed or hold, else what the config declares."""
        windowed = [c for c in self.calls if c.window]
        if windowed:
            call = min(windowed, key=lambda c: c.window or 0)
            return call.window or 0, f"{call.name} (layer {call.layer})"
        if self.config_window:
            return self.config_window, "the config"
        return None

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict, mask: Any = None) -> tuple[torch.Tensor, None]:
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        sinks = kwargs.get("s_aux")
        self.calls.append(Call(
            name=self.names.get(id(module), type(module).__name__), cls=type(module).__name__,
            layer=getattr(module, "layer_idx", None), with_step=kwargs.get("graphmode_step") is self,
            key=tuple(key.shape), value=tuple(value.shape), window=int(window) if window else None,
            softcap=kwargs.get("softcap"), sinks=None if sinks is None else _describe(module, sinks),
            causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
            mask=None if mask is None else (_describe(module, mask), mask),
        ))
        batch, heads, tokens = query.shape[:3]
        return query.new_zeros(batch, tokens, heads, value.shape[-1]), None

    def refuse(self) -> None:
        """Raise for the first thing the calls show the adapter cannot run."""
        family, where = self.family, f"(transformers {_version()})"
        if not self.calls:
            raise ConfigError(
                f"{family!r} is not supported: no layer called transformers' attention interface {where}, "
                f"so graphmode's paged attention is never used; {SUPPORTED}"
            )
        for call in self.calls:
            if not call.with_step:
                raise ConfigError(
                    f"{family!r} is not supported {where}: {call.name} ({call.cls}) is called without the "
                    "keyword arguments of the model's forward (its decoder layer passes only its own "
                    "arguments to attention), so graphmode's step (the paged KV cache and the step's "
                    f"metadata) cannot reach it. Use another family or transformers version; {SUPPORTED}"
                )
            if call.layer is None:
                raise ConfigError(
                    f"{family!r} is not supported: {call.name} ({call.cls}) has no layer_idx, which the adapter "
                    f"needs to pick the layer's KV cache; {SUPPORTED}"
                )
            if not call.causal:
                raise ConfigError(
                    f"{family!r} is not supported: {call.name} ({call.cls}) attends bidirectionally (is_causal is "
                    "False); graphmode serves decoder-only models, whose attention is causal. For an encoder "
                    f"configured as a decoder, set config.is_decoder=True; {SUPPORTED}"
                )
            if call.softcap is not None:
                raise ConfigError(
                    f"{family!r} is not supported: {call.name} passes softcap={call.softcap} (attention logit "
                    "soft-capping), which graphmode's paged attention kernels do not implement. Use a model "
                    f"without attention soft-capping; {SUPPORTED}"
                )
            if call.sinks is not None:
                raise ConfigError(
                    f"{family!r} is not supported: {call.name} has attention sinks ({call.sinks}: a learned logit "
                    "per head in every softmax), which graphmode's paged attention kernels do not implement. Use "
                    f"a model without attention sinks; {SUPPORTED}"
                )
            if call.mask is not None and _is_bias(call.mask[1]):  # read here: the forward's host reads count
                raise ConfigError(f"{family!r} is not supported: {call.name} ({call.cls}) passes attention a bias as "
                                  f"its mask ({call.mask[0]}; Doge's, from its values), which graphmode's paged kernels "
                                  f"ignore, giving other logits. Use a model without one; {SUPPORTED}")
            if call.key[1:2] + call.key[3:] != call.value[1:2] + call.value[3:]:
                raise ConfigError(
                    f"{family!r} is not supported: {call.name} gives keys of shape {call.key} and values of shape "
                    f"{call.value} (batch, heads, tokens, head size): graphmode's paged cache holds keys and values "
                    f"of one head count and head size (multi-head latent attention is not supported); {SUPPORTED}"
                )
        # Each call writes its keys and values into its layer's one cache; a
        # second call of a layer would overwrite the first's values, so the
        # first would attend to the second's at every later step.
        twice = next((c for i, c in enumerate(self.calls) if c.layer in {d.layer for d in self.calls[:i]}), None)
        if twice is not None:
            count = sum(c.layer == twice.layer for c in self.calls)
            raise ConfigError(
                f"{family!r} is not supported: {twice.name} ({twice.cls}) calls transformers' attention interface "
                f"{count} times per forward for layer_idx {twice.layer} (differential attention calls it twice with "
                "other values; a model that loops over its layers, once a pass), and graphmode's paged cache holds "
                f"one key and value per token and layer, which the second call would overwrite; {SUPPORTED}"
            )
        layers = sorted({c.layer for c in self.calls if c.layer is not None})
        if layers != list(range(self.num_layers)):
            missing = sorted(set(range(self.num_layers)) - set(layers))
            why = (f"layers {missing} never called it (recurrent, convolutional or linear-attention layers keep a "
                   "state graphmode's paged KV cache does not hold)" if missing else "each needs one KV cache of its own")
            raise ConfigError(
                f"{family!r} is not supported: the attention layers that called transformers' attention interface "
                f"have layer_idx {layers}, but the model has {self.num_layers} layers (config.num_hidden_layers); "
                f"{why}; {SUPPORTED}"
            )
        shapes = {(c.key[1], c.key[3]) for c in self.calls}
        if len(shapes) > 1:
            raise ConfigError(
                f"{family!r} is not supported: its layers have different (KV heads, head size): {sorted(shapes)}; "
                f"graphmode's KV cache has one geometry for every layer; {SUPPORTED}"
            )

    @property
    def kv_heads(self) -> int:
        return self.calls[0].key[1]

    @property
    def head_dim(self) -> int:
        return self.calls[0].key[3]

    def check_graphs(self, execute_mode: str) -> None:
        """Refuse graph modes for a forward that runs an operator whose output
        size depends on tensor values (MoE routing with ``nonzero``, say), or
        reads device memory on the host (``.tolist()``, a tensor in an
        ``if``): every capture would fail on it."""
        if self.value_sized is not None:
            (what, where), why = self.value_sized, "whose output size depends on tensor values"
        elif self.host_read is not None:
            (what, where), why = self.host_read, "which reads device memory on the host"
        if execute_mode == "eager" or self.value_sized is self.host_read is None:
            return
        raise ConfigError(
            f"{self.family!r} cannot run in execute_mode={execute_mode!r} (transformers {_version()}): its forward "
            f"calls {what} at {where}, {why}, so no device graph can capture it. Build the runner with "
            f"execute_mode='eager', or use a transformers version whose model avoids the call; {SUPPORTED}"
        )

    def check_table(self, max_blocks_per_seq: int, block_size: int) -> None:
        """Refuse a block table that can address more tokens than a layer's
        sliding window (the paged kernels attend to the whole sequence) or
        than a :func:`rope_switch` length."""
        found = self.window
        reach = max_blocks_per_seq * block_size
        if self.rope is not None and reach > self.rope[1]:
            kind, limit, name = self.rope
            raise ConfigError(
                f"{self.family!r}: its RoPE (rope_type {kind!r}) changes its frequencies for a whole step once the "
                f"step's longest position passes {limit} tokens (config.{name}), but the block table can address "
                f"{reach} tokens (max_blocks_per_seq {max_blocks_per_seq} x block_size {block_size}): one sequence's "
                "length would change the RoPE of the others in its step, and the tokens would differ from generate's. "
                f"Lower the table width (max_blocks_per_seq * block_size <= {limit}), or use a RoPE without it")
        if found is not None and reach > found[0]:
            window, where = found
            raise ConfigError(
                f"{self.family!r}: {where} has a sliding window of {window} tokens (config.sliding_window), but "
                f"the block table can address {reach} tokens (max_blocks_per_seq {max_blocks_per_seq} x block_size {block_size}), "
                "and graphmode's paged kernels attend to the whole sequence, not to a window. Raise the window, "
                f"lower the table width (max_blocks_per_seq * block_size <= {window}), or use a model without sliding window"
            )


def _is_bias(mask: Any) -> bool:
    """Whether a mask reaching attention holds a float other than 0 or the
    dtype's minimum: a bias (Doge's; 1.0 with untrained weights), not the
    causal mask transformers 4.x builds in OPT or Persimmon for every
    implementation, which the paged kernels' causal rule computes."""
    if not isinstance(mask, torch.Tensor) or mask.dtype == torch.bool or not mask.is_floating_point():
        return False
    masked = mask <= torch.finfo(mask.dtype).min / 2
    return bool(((mask != 0) & ~masked).any())


def _describe(module: Any, tensor: Any) -> str:
    """A tensor's name in ``module`` and its shape, never its values."""
    shape = tuple(getattr(tensor, "shape", ()))
    for name, parameter in module.named_parameters(recurse=False):
        if parameter is tensor:
            return f"{type(module).__name__}.{name}, shape {shape}"
    return f"a tensor of shape {shape}"


def active_probe() -> Probe | None:
    """The probe of the forward running now, if any."""
    return _PROBE.get()


@contextlib.contextmanager
def _probing(probe: Probe) -> Iterator[None]:
    token = _PROBE.set(probe)
    try:
        yield
    finally:
        _PROBE.reset(token)


def probe(hf_model: Any) -> Probe:
    """Run one token through ``hf_model`` (already switched to graphmode's
    attention) with a recording attention function; return what it saw,
    having refused what the adapter cannot run."""
    config = hf_model.config
    family = getattr(config, "model_type", type(hf_model).__name__)
    seen = Probe(family, config.num_hidden_layers, {id(m): n for n, m in hf_model.named_modules()},
                 config_window=config_window(config), rope=rope_switch(config))
    device = next(hf_model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with _probing(seen), torch.no_grad(), ValueSizedOps() as sized, HostReads() as reads:
        try:
            hf_model(input_ids=ids, position_ids=ids, use_cache=False, graphmode_step=seen)
        except TypeError as error:
            if "graphmode_step" not in str(error):
                raise
            raise ConfigError(
                f"{family!r} is not supported: {type(hf_model).__name__}.forward takes no extra keyword arguments "
                f"({error}), so graphmode's step cannot reach the attention layers; {SUPPORTED}"
            ) from None
    seen.value_sized, seen.host_read = sized.found, reads.found
    seen.refuse()
    return seen
