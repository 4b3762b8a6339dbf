"""Hugging Face decoder-only models on graphmode's paged KV cache.

Any ``transformers`` causal LM whose attention layers call transformers'
attention interface (``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``)
with the model's keyword arguments and carry ``layer_idx`` runs unchanged:
docs/engines.md lists the families tested, and those refused. The adapter

- registers :func:`paged_attention` with ``transformers.AttentionInterface``
  under :data:`ATTENTION` and selects it on the model, so each attention layer
  writes its keys and values into graphmode's paged cache with the vendor's
  ``fill_kv_cache`` and attends with ``paged_decode_attention`` (decode steps:
  one token per sequence, or several in speculative verify steps, causal
  among them) or ``prefill_attention`` (prefill and chunks);
- wraps the model in :class:`HuggingFaceModel`, which has graphmode's model
  contract (``input_ids``/``position_ids`` (1, T), ``past_key_values`` = one
  (key, value) cache pair per layer in the vendor's layout, ``attn_metadata``)
  and returns logits (1, T, vocab).

Inside the forward nothing reads the device on the host: HF's own cache is off
(``use_cache=False``, no ``DynamicCache``), positions are passed explicitly
(no ``cache_position`` arithmetic on a cache length), and transformers builds
no attention mask for an attention implementation it has no mask function for
(``masking_utils._preprocess_mask_arguments`` returns None), so the forward is
capturable as a device graph. Transformers >= 4.53 (``masking_utils``) is
required; 5.x works the same.

Families and features the paged kernels do not have are refused at load
(``huggingface_support``: from the config, then a one-token probe), never
approximated: composite (multimodal) configs, attention outside the
interface, a layer calling attention more than once per forward, logit
soft-capping, attention sinks, a bias passed as the attention mask, chunked or linear attention layers, keys and
values of different head sizes. When the runner is built
(:meth:`HuggingFaceModel.check_runner`): a block table that can address more
tokens than a layer's sliding window, or than the length past which a
``longrope`` or ``dynamic`` RoPE changes a whole step's frequencies; in graph
modes, a forward with a value-sized operator or a host read of device memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphmode.context import AttnMetadata
from graphmode.errors import ConfigError, InputError
from graphmode.integrations.huggingface_support import Probe, active_probe, probe, refuse_config

__all__ = [
    "ATTENTION",
    "MIN_TRANSFORMERS",
    "PRESETS",
    "HuggingFaceModel",
    "PagedStep",
    "load_model",
    "paged_attention",
    "random_config",
    "register_attention",
]

#: The name of graphmode's attention in transformers' AttentionInterface.
ATTENTION = "graphmode_paged"
#: The oldest transformers whose models build no mask for a custom attention.
MIN_TRANSFORMERS = "4.53"

#: Random-model configurations by name: family and config fields. The tiny
#: ones run the CPU tests in seconds; ``llama-1b`` is Llama-3.2-1B's shape
#: (with a 32k vocabulary, untied head): 1.1 B parameters.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("llama", {}),
    "mistral-tiny": ("mistral", {}),
    "qwen2-tiny": ("qwen2", {}),
    "qwen3-tiny": ("qwen3", {"head_dim": 16}),
    "llama-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
    )),
}
_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
)


@dataclass
class PagedStep:
    """What :func:`paged_attention` needs beyond HF's arguments, passed
    through the model's forward keyword arguments as ``graphmode_step``.

    ops: the vendor's attention ops; kv_cache: one (key, value) pair per
    layer, indexed by the attention module's ``layer_idx``; attn: the step's
    AttnMetadata; block_size: tokens per cache block.
    """

    ops: Any
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]
    attn: AttnMetadata
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.attn, AttnMetadata):
            raise InputError(f"attn_metadata is a {type(self.attn).__name__}; pass a graphmode.AttnMetadata")
        if self.block_size < 1:
            raise InputError(f"block_size={self.block_size}; it must be >= 1")


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on graphmode's paged cache.

    query (1, H, T, D), key and value (1, K, T, D) for the step's T new tokens
    of all sequences back to back; returns ((1, T, H, D), None). Writes key and
    value to the slots ``attn.kv_start_indices`` of layer ``module.layer_idx``,
    then attends causally over each sequence's cached tokens. The mask
    argument is ignored: the paged kernels mask by ``kv_seqlens`` (and
    transformers builds none for this implementation).
    """
    probe = active_probe()
    if probe is not None:  # the load-time probe: record, attend to nothing
        return probe.record(module, query, key, value, kwargs, attention_mask)
    step = kwargs.get("graphmode_step")
    if not isinstance(step, PagedStep):
        raise ConfigError(
            f"the model's attention is {ATTENTION!r}, which needs graphmode's step (the paged KV cache and "
            "AttnMetadata); call it through graphmode.integrations.huggingface.HuggingFaceModel, or set "
            "model.config._attn_implementation back to 'sdpa' to call the HF model directly"
        )
    _refuse_unsupported(module, dropout, kwargs)
    if query.shape[0] != 1:
        raise InputError(
            f"the query has batch dimension {query.shape[0]}; graphmode passes every sequence's tokens in one "
            "row (input_ids of shape (1, T))"
        )
    ops, attn = step.ops, step.attn
    k_cache, v_cache = step.kv_cache[module.layer_idx]
    # (1, heads, T, D) -> (T, heads, D), the layout of graphmode's ops.
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    ops.fill_kv_cache(k, v, k_cache, v_cache, attn)
    # A flag, not values, chooses the kernel, so the choice is graph-safe. A
    # decode step may carry several new tokens per sequence (a speculative
    # verify step): the decode kernel is causal among them.
    if attn.is_decoding:
        out = ops.paged_decode_attention(q, k_cache, v_cache, attn, scale)
    else:
        out = ops.prefill_attention(q, k_cache, v_cache, attn, scale)
    return out[None], None


def _refuse_unsupported(module: Any, dropout: float, kwargs: dict) -> None:
    """Raise for what the paged kernels would silently compute differently
    (the load-time probe refused these already; a guard for models wrapped
    in other ways)."""
    if getattr(module, "layer_idx", None) is None:
        raise ConfigError(
            f"{type(module).__name__} has no layer_idx; the adapter needs it to pick the layer's KV cache "
            "(every transformers decoder attention module that uses the attention interface sets it)"
        )
    if dropout:
        raise ConfigError(f"attention dropout {dropout}; graphmode serves inference only: call model.eval()")
    for name, feature in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{type(module).__name__} passes {name} ({feature}), which graphmode's paged attention does not "
                "implement; this model is not supported"
            )


def register_attention() -> None:
    """Register :func:`paged_attention` as :data:`ATTENTION` (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)


class HuggingFaceModel(nn.Module):
    """A transformers causal LM with graphmode's model contract.

    ``model(input_ids, position_ids, past_key_values, attn_metadata)`` with
    (1, T) ids and positions and one (key, value) cache pair per layer in the
    vendor's layout (:meth:`make_kv_cache`) returns logits (1, T, vocab).
    Wrapping switches the HF model's attention to :data:`ATTENTION` and
    probes it with one token (:func:`~graphmode.integrations.huggingface_support.probe`):
    a family or feature the adapter cannot run is refused here, and the
    cache geometry (KV heads, head size) is the one the layers showed.
    ``model.config`` is the HF config.
    """

    hf_model: Any
    config: Any

    def __init__(self, hf_model: Any, ops: Any) -> None:
        super().__init__()
        register_attention()
        refuse_config(hf_model.config)
        hf_model.config._attn_implementation = ATTENTION
        self.hf_model = hf_model.eval()
        self.ops = ops
        self.config = hf_model.config
        self.block_size: int | None = None
        self.support: Probe = probe(self.hf_model)

    @property
    def num_kv_heads(self) -> int:
        return self.support.kv_heads

    @property
    def head_dim(self) -> int:
        return self.support.head_dim

    def check_runner(self, config: Any) -> None:
        """Refuse, when a runner is built for this model, a block table that
        can address more tokens than a layer's sliding window (the paged
        kernels attend to the whole sequence), and graph modes for a forward
        no graph can capture (the probe saw a value-sized operator), and
        keywords the forward would refuse at every step (graph variants,
        step inputs)."""
        keywords = [*config.graph_variants, *(spec.name for spec in config.step_inputs)]
        if keywords:
            raise ConfigError(
                f"the Hugging Face adapter's forward takes no keyword beyond the model contract, so {keywords} "
                "(graph_variants, step_inputs) would be refused at every step: build the runner without them "
                "(LoRA graphs: graphmode.model.lora on the reference model)"
            )
        self.support.check_table(config.max_blocks_per_seq, config.block_size)
        self.support.check_graphs(config.execute_mode)

    def make_kv_cache(
        self, num_cache_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A paged KV cache in the vendor's layout, in the model's dtype, of
        ``num_cache_blocks`` blocks shared by every sequence (block 0 reserved
        for padding, as every graphmode cache)."""
        weight = next(self.hf_model.parameters())
        self.block_size = block_size
        return self.ops.make_kv_cache(
            self.config.num_hidden_layers, num_cache_blocks, block_size, self.num_kv_heads, self.head_dim,
            weight.dtype, torch.device(device) if device is not None else weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttnMetadata,
        **extras: Any,
    ) -> torch.Tensor:
        if extras:
            raise InputError(f"unexpected arguments {sorted(extras)}; the HF adapter takes none beyond the contract")
        if len(past_key_values) != self.config.num_hidden_layers:
            raise InputError(
                f"past_key_values has {len(past_key_values)} layers; the model has "
                f"{self.config.num_hidden_layers}: make it with make_kv_cache"
            )
        if self.block_size is None:
            raise InputError("make the KV cache with HuggingFaceModel.make_kv_cache, which records its block size")
        step = PagedStep(self.ops, past_key_values, attn_metadata, self.block_size)
        self.support.check_table(attn_metadata.block_offsets.shape[-1], self.block_size)
        output = self.hf_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, return_dict=True,
            graphmode_step=step,
        )
        return output.logits


def random_config(name: str, **overrides: Any) -> Any:
    """The transformers config of preset ``name`` (see :data:`PRESETS`),
    with ``overrides`` applied."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    family, fields = PRESETS[name]
    settings = {**(_TINY if name.endswith("-tiny") else {}), **fields, **overrides}
    return AutoConfig.for_model(family, **settings)


def load_model(
    path_or_config: str | os.PathLike | Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    vendor: Any = None,
    seed: int = 0,
    vendor_options: Any = None,
) -> HuggingFaceModel:
    """A :class:`HuggingFaceModel` on ``device`` in ``dtype`` with the
    attention ops of ``vendor`` (a :class:`graphmode.Vendor`, a name, or None
    for the vendor graphmode selects on ``device``).

    path_or_config: a local model directory (``config.json`` and weights; read
    with ``local_files_only=True``, nothing is downloaded), a GGUF file
    (transformers dequantizes its weights to ``dtype``; needs the ``gguf``
    and ``accelerate`` packages: ``pip install 'graphmode[gguf]'``), or a
    transformers config, which gets random weights drawn with ``seed``.
    vendor_options: the vendor's options for its attention ops (what the
    engine passes the runner too).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    from graphmode.plugins import Vendor, select_vendor

    _check_transformers()
    register_attention()
    chosen = vendor if isinstance(vendor, Vendor) else select_vendor(vendor, device)
    ops = chosen.attention_ops(vendor_options)
    options = {"attn_implementation": ATTENTION, _dtype_argument(): dtype}
    if isinstance(path_or_config, PretrainedConfig):
        refuse_config(path_or_config)  # before any weight is drawn
        # Drawn on the CPU, so that a seed gives the same weights on every device.
        torch.manual_seed(seed)
        hf_model = AutoModelForCausalLM.from_config(path_or_config, **options)
    else:
        path = os.fspath(path_or_config)
        where: dict[str, Any] = {"local_files_only": True}
        if path.endswith(".gguf") and os.path.isfile(path):
            _check_gguf(path)
            path, where["gguf_file"] = os.path.split(os.path.abspath(path))
        elif not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} is not a model directory (no config.json) nor a .gguf file; pass a local "
                              "HF model directory or GGUF file")
        refuse_config(AutoConfig.from_pretrained(path, **where))  # before the weights are read
        hf_model = AutoModelForCausalLM.from_pretrained(path, **where, **options)
    return HuggingFaceModel(hf_model.to(device), ops)


def _transformers_version() -> tuple[int, ...]:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release


def _check_transformers() -> None:
    from packaging.version import Version

    found = _transformers_version()
    if found < Version(MIN_TRANSFORMERS).release:
        raise ConfigError(
            f"transformers {'.'.join(map(str, found))} is installed; the HF adapter needs >= {MIN_TRANSFORMERS} "
            "(its models build no attention mask for a custom attention): pip install 'graphmode[hf]'"
        )


def _check_gguf(path: str) -> None:
    """transformers reads GGUF files with the ``gguf`` package, and loads them
    only with ``accelerate`` installed."""
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{path!r} is a GGUF file, which transformers reads only with {' and '.join(missing)} "
                          "installed: pip install 'graphmode[gguf]'")


def _dtype_argument() -> str:
    """``dtype=`` since transformers 4.56; ``torch_dtype=`` before."""
    return "dtype" if _transformers_version() >= (4, 56) else "torch_dtype"
