"""RunnerConfig: what an engine asks of graph mode, checked once at start-up.

The vendor's ``graphmode_check_config`` hooks see it before anything is
allocated and may refuse it or fill in vendor options.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmode.errors import ConfigError
from graphmode.spec import MODEL_INPUTS, BufferSpec
from graphmode.variants import clean_graph_variants

__all__ = [
    "ENV_DEBUG",
    "ENV_EXECUTE_MODE",
    "EXECUTE_MODES",
    "GRAPHED_COMPILE_MODES",
    "RunnerConfig",
    "resolve_debug",
    "resolve_execute_mode",
]

# "graph": full graphs for decode steps (the rest eager); "piecewise": every
# step in piecewise graphs (graphmode.families.piecewise); "full_and_piecewise": full
# graphs for uniform decode, piecewise for the rest (vLLM's FULL_AND_PIECEWISE).
EXECUTE_MODES = ("graph", "piecewise", "full_and_piecewise", "eager")
ENV_EXECUTE_MODE = "GRAPHMODE_EXECUTE_MODE"
ENV_DEBUG = "GRAPHMODE_DEBUG"
# torch.compile modes that leave graph capture to graphmode: "reduce-overhead"
# and "max-autotune" record CUDA graphs of their own, which cannot nest in ours.
GRAPHED_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# What compile=True passes to torch.compile unless compile_options says else:
# one compilation with a symbolic batch serves every bucket (vLLM's choice);
# dynamic=False would compile every bucket anew (SGLang, for small batches).
DEFAULT_COMPILE_OPTIONS: dict[str, Any] = {"dynamic": True}


def resolve_execute_mode(requested: str | None) -> str:
    """The execute mode: the environment variable wins over the argument.

    The variable exists so an operator can switch a deployed engine to eager
    mode (the reference path) without touching its code.
    """
    mode = os.environ.get(ENV_EXECUTE_MODE) or requested or "graph"
    mode = mode.strip().lower()
    if mode not in EXECUTE_MODES:
        source = f"${ENV_EXECUTE_MODE}" if os.environ.get(ENV_EXECUTE_MODE) else "execute_mode"
        raise ConfigError(
            f"{source}={mode!r} is not an execute mode; use one of {', '.join(EXECUTE_MODES)}"
        )
    return mode


def resolve_debug(requested: bool) -> bool:
    """Debug mode: ``$GRAPHMODE_DEBUG`` ("1" or "0") wins over the argument,
    so that an operator can switch a deployed engine's checks on (or off)
    without touching its code."""
    value = os.environ.get(ENV_DEBUG, "").strip().lower()
    if not value:
        if not isinstance(requested, bool):
            raise ConfigError(f"debug={requested!r}: must be True or False")
        return requested
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"${ENV_DEBUG}={value!r}: use 1 (debug checks on) or 0 (off)")


@dataclass
class RunnerConfig:
    """Graph-mode settings of one runner.

    max_batches: the most sequences the engine ever puts in one decode step.
    max_blocks_per_seq: the widest block table a sequence may have (its
        columns; the KV cache's own size is ``make_kv_cache``'s
        ``num_cache_blocks``).
    block_size: tokens per KV-cache block.
    device: the model's device; "cpu" runs the graph emulator.
    execute_mode: one of EXECUTE_MODES (``$GRAPHMODE_EXECUTE_MODE`` overrides).
    capture_batch_sizes: the user's bucket list; None lets the vendor choose.
    head_dim: the model's attention head size, for vendors whose kernels
        take only some (read from ``model.config``); None when unknown.
    vendor_options: settings for the vendor plugin: a dict of the fields of
        its options dataclass (``GraphSpec.options``), or an instance of it.
        The runner replaces it with the checked options object.
    step_inputs: the engine's own per-step model inputs
        (:class:`graphmode.spec.BufferSpec`, e.g. LoRA ids per sequence):
        each gets a buffer filled every step with the rest, and reaches the
        model as a view of it, under its name in the step's extras.
    compile: run the graphs over ``torch.compile(model)`` (Inductor
        kernels captured inside graphmode's graphs; piecewise graphs over
        the compiled forward split at the attention calls, see
        ``graphmode.families.piecewise.compiled``); eager steps run the model
        uncompiled. Ignored in eager mode; only for vendors declaring the
        ``inductor_graphs`` capability, never on the CPU emulator.
    compile_options: keyword arguments for ``torch.compile``, over
        ``{"dynamic": True}``; ``mode`` must be one of GRAPHED_COMPILE_MODES.
    host_staging: feed the graphs' input buffers from one pinned host mirror
        (see ``graphmode.staging``): True requires it (the step inputs must
        then be host tensors), False keeps the device-side fill, None decides
        at the first graph step: on when that step's inputs are host tensors
        and the vendor allows it.
    debug: before every step (graph or eager), read the step's device values
        (one synchronisation) and refuse slots, block ids and lengths that
        would give wrong results, and tensors a graph captured that moved
        (``graphmode.checks.debug``); ``$GRAPHMODE_DEBUG`` overrides. Off by
        default: it costs a device-to-host read per step.
    capture_token_sizes: the token buckets of piecewise graphs (piecewise
        modes only); None takes vLLM's default list up to
        ``min(2 * max_batches, 512)`` (graphmode.families.piecewise.default_token_sizes).
    max_q_len: the most new tokens per sequence a decode graph takes
        (speculative verify and MTP steps carry ``1 + k``): a decode step
        whose sequences all carry the same ``q_len <= max_q_len`` replays the
        graph of (batch bucket, q_len); the buffers hold ``max_batches x
        max_q_len`` tokens. 1 (the default) graphs one-token decode only.
    """

    max_batches: int
    max_blocks_per_seq: int
    block_size: int
    device: torch.device
    execute_mode: str = "graph"
    capture_batch_sizes: tuple[int, ...] | None = None
    head_dim: int | None = None
    vendor_options: Any = None
    step_inputs: tuple[BufferSpec, ...] = ()
    compile: bool = False
    compile_options: dict[str, Any] = field(default_factory=dict)
    host_staging: bool | None = None
    debug: bool = False
    capture_token_sizes: tuple[int, ...] | None = None
    max_q_len: int = 1
    graph_variants: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    host_bookkeeping: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.host_staging not in (True, False, None):
            raise ConfigError(f"host_staging={self.host_staging!r}: use True, False or None (decide at the first graph step)")
        self.device = _with_index(torch.device(self.device))
        for name in ("max_batches", "max_blocks_per_seq", "block_size", "max_q_len"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not isinstance(value, int) and hasattr(value, "__index__"):
                value = operator.index(value)  # a numpy or torch integer, as an engine's config may hold
                setattr(self, name, value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                kind = "" if isinstance(value, (int, float)) else f" (a {type(value).__name__})"
                raise ConfigError(f"{name}={value!r}{kind}: must be a positive integer; pass int({name}) of at least 1")
        self.execute_mode = resolve_execute_mode(self.execute_mode)
        if self.capture_batch_sizes is not None:
            self.capture_batch_sizes = _clean_capture_sizes(
                self.capture_batch_sizes, self.max_batches
            )
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile={self.compile!r}: must be True or False")
        self.compile_options = _clean_compile_options(self.compile, self.compile_options)
        wrong = [s for s in self.step_inputs if not isinstance(s, BufferSpec)]
        if wrong:
            raise ConfigError(f"step_inputs has {wrong!r}; declare each as graphmode.spec.BufferSpec(name, dtype, ...)")
        self.step_inputs = tuple(s.bound(MODEL_INPUTS) for s in self.step_inputs)
        self.graph_variants = clean_graph_variants(self.graph_variants, tuple(s.name for s in self.step_inputs))
        self.debug = resolve_debug(self.debug)
        self.host_bookkeeping = _clean_names(self.host_bookkeeping)
        if self.capture_token_sizes is not None:
            from graphmode.token_buckets import clean_token_sizes

            self.capture_token_sizes = clean_token_sizes(self.capture_token_sizes)

    @property
    def max_tokens(self) -> int:
        """The most new tokens of a graph step: ``max_batches x max_q_len``."""
        return self.max_batches * self.max_q_len

    @property
    def torch_compile_options(self) -> dict[str, Any]:
        """The keyword arguments given to ``torch.compile`` when compile=True."""
        return {**DEFAULT_COMPILE_OPTIONS, **self.compile_options}


def _clean_compile_options(compile: bool, options: Any) -> dict[str, Any]:
    """A dict of torch.compile arguments that leave capture to graphmode."""
    if not isinstance(options, dict):
        raise ConfigError(f"compile_options={options!r}: must be a dict of torch.compile arguments")
    if options and not compile:
        raise ConfigError(f"compile_options={options!r} given with compile=False; pass compile=True to use them")
    mode = options.get("mode") or "default"
    if mode not in GRAPHED_COMPILE_MODES:
        raise ConfigError(
            f"compile_options mode={mode!r} records CUDA graphs of its own, which cannot run inside "
            f"graphmode's graphs; use one of {', '.join(GRAPHED_COMPILE_MODES)}"
        )
    if (options.get("options") or {}).get("triton.cudagraphs"):
        raise ConfigError(
            "compile_options options={'triton.cudagraphs': True} records CUDA graphs inside "
            "graphmode's graphs; leave it False"
        )
    return dict(options)


def _clean_names(names: Any) -> tuple[str, ...]:
    """``host_bookkeeping`` as a tuple of non-empty strings."""
    if isinstance(names, str):
        raise ConfigError(f"host_bookkeeping={names!r}: give a tuple of attribute names, ({names!r},)")
    try:
        cleaned = tuple(names)
    except TypeError:
        raise ConfigError(f"host_bookkeeping={names!r}: give a tuple of attribute names") from None
    bad = [name for name in cleaned if not isinstance(name, str) or not name]
    if bad:
        raise ConfigError(
            f"host_bookkeeping has {bad!r}: each must be an attribute name as capture errors give it "
            "('calls', 'layers.0.timings') or an fnmatch pattern ('layers.*.timings')"
        )
    return cleaned


def _with_index(device: torch.device) -> torch.device:
    """"cuda" means the current device: name it, so that it compares equal to
    the devices of the tensors on it ("cuda:0")."""
    if device.type == "cpu" or device.index is not None:
        return device
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(device.type, module.current_device())
    return device


def _clean_capture_sizes(sizes: Any, max_batches: int) -> tuple[int, ...]:
    """Sorted, unique, each within 1..max_batches; anything else is an error."""
    try:
        values = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise ConfigError(
            f"capture_batch_sizes={sizes!r}: must be a list of integers"
        ) from None
    if not values:
        raise ConfigError(
            "capture_batch_sizes is empty: give at least one size, or None to "
            "let the vendor choose, or execute_mode='eager' to capture nothing"
        )
    bad = [v for v in values if not 1 <= v <= max_batches]
    if bad:
        raise ConfigError(
            f"capture_batch_sizes has {bad}, outside 1..max_batches={max_batches}; "
            "drop those sizes or raise max_batches"
        )
    return tuple(sorted(set(values)))
