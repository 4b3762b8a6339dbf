"""The seam: where graphmode enters lmdeploy, and the check that it is still there.

lmdeploy has no setting for "build the graph runner with this factory".
Every place that builds one (``ModelAgent.build_graph_runner``, the
speculative agent's, the memory-decode agent's) asks the op backend of the
device type: ``get_backend().build_graph_runner(model, model_config=...,
cache_config=..., backend_config=..., device=...)``. The narrowest seam is
that static method on each backend class: graphmode replaces it with one
that builds lmdeploy's own runner first (which also runs the backend's op
warm-up) and returns graphmode's runner around it. No lmdeploy file is
changed; ``uninstall()`` puts the originals back.

What graphmode's runner calls in lmdeploy is checked by :func:`check_seam`
before anything is replaced, so that an lmdeploy release that moved any of
it stops at start-up with :class:`SeamError` naming the version and what
moved, rather than running lmdeploy's own runner under graphmode's name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from graphmode.errors import ConfigError

__all__ = ["BACKENDS", "TESTED_VERSIONS", "SeamError", "check_seam", "install", "installed", "uninstall"]

#: lmdeploy releases this integration was run against.
TESTED_VERSIONS = ("0.18.0",)

#: lmdeploy's op backend class of each device type: (module, class).
BACKENDS = {
    "cuda": ("lmdeploy.pytorch.backends.cuda.op_backend", "CudaOpsBackend"),
    "ascend": ("lmdeploy.pytorch.backends.dlinfer.ascend.op_backend", "AscendOpsBackend"),
    "camb": ("lmdeploy.pytorch.backends.dlinfer.camb.op_backend", "CambOpsBackend"),
    "maca": ("lmdeploy.pytorch.backends.dlinfer.maca.op_backend", "MacaOpsBackend"),
}

_BUILD_PARAMETERS = ["model", "model_config", "cache_config", "backend_config", "device"]

#: (module, attribute, the parameters it must take, in order, after self).
_USED: tuple[tuple[str, str, list[str] | None], ...] = (
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.__init__", [*_BUILD_PARAMETERS, "kwargs"]),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.get_meta", []),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.get_capture_batch_sizes", []),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.get_prefill_warmup_token_sizes", []),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.update_inputs", ["inputs"]),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunner.reset", []),
    ("lmdeploy.pytorch.backends.graph_runner", "GraphRunnerMeta.padding_batch_size", None),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.support_cuda_graph",
     ["input_ids", "position_ids", "past_key_values", "attn_metadata", "inputs_embeds", "kwargs"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.get_cudagraph_extra_key", ["kwargs"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.make_buffers_cudagraph",
     ["graph_meta", "input_ids", "position_ids", "past_key_values", "attn_metadata", "inputs_embeds", "kwargs"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.fill_buffers_cudagraph",
     ["graph_meta", "input_ids", "position_ids", "past_key_values", "attn_metadata", "inputs_embeds", "kwargs"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.update_context_cudagraph", ["graph_meta", "context"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.get_outputs_cudagraph",
     ["output_buffers", "input_ids", "kwargs"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMixin.make_output_buffers", ["output"]),
    ("lmdeploy.pytorch.models.utils.cudagraph", "CudaGraphMeta.step_meta_plan", None),
    ("lmdeploy.pytorch.backends.cuda.graph_runner.full_graph", "_make_graph_meta",
     ["model_config", "ctx_mgr", "max_batches", "max_tokens", "num_blocks", "is_decoding", "decode_query_len",
      "device"]),
    ("lmdeploy.pytorch.backends.cuda.graph_runner.full_graph", "build_decode_model_forward", ["model"]),
    ("lmdeploy.pytorch.backends.cuda.graph_runner.runner", "_update_deepep_mode", ["context"]),
    ("lmdeploy.pytorch.model_inputs", "StepContext.global_is_decoding", []),
    ("lmdeploy.pytorch.model_inputs", "StepContext.enable_microbatch", None),
    ("lmdeploy.pytorch.model_inputs", "StepContext.is_dummy", None),
    ("lmdeploy.pytorch.engine.executor.mp_executor", "ExecutorProc.__init__", ["proc_id", "mp_ctx"]),
    ("lmdeploy.pytorch.engine.executor.mp_executor", "ExecutorProc.start", ["kwargs"]),
    ("lmdeploy.pytorch.engine.executor.mp_executor", "ExecutorProc._main_loop", None),
)

#: Instance attributes graphmode reads, set in their class's ``__init__``: (module, class, attribute).
_INSTANCE_ATTRIBUTES = (
    # lmdeploy's piecewise graphs, whose cuBLAS workspace graphmode's captures must not free (runner.py).
    ("lmdeploy.pytorch.backends.cuda.graph_runner.runner", "CUDAGraphRunner", "_piecewise_graph_manager"),
)

#: The class whose ``start`` launches a tensor-parallel worker process (``workers.py``).
WORKER_PROCESS = ("lmdeploy.pytorch.engine.executor.mp_executor", "ExecutorProc")

#: (class, attribute) -> lmdeploy's own, while graphmode's is installed.
_ORIGINALS: dict[tuple[type, str], Any] = {}


class SeamError(ConfigError):
    """lmdeploy is not the shape graphmode's integration was written for."""


def lmdeploy_version() -> str:
    """The installed lmdeploy's version; ConfigError when none is installed."""
    try:
        import lmdeploy
    except ImportError as error:
        raise ConfigError(
            "graphmode.integrations.lmdeploy needs lmdeploy's PyTorch engine: pip install lmdeploy "
            f"(run against {', '.join(TESTED_VERSIONS)}); import failed: {error}"
        ) from error
    return str(getattr(lmdeploy, "__version__", "unknown"))


def _find(module_name: str, path: str) -> Any:
    """``module.path`` (dotted through classes), or a string saying why not.
    A dataclass field with a default is found as the class attribute."""
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        return f"{module_name} does not import ({error})"
    for part in path.split("."):
        fields = getattr(target, "__dataclass_fields__", {})
        if part in fields:
            target = fields[part]
            continue
        if not hasattr(target, part):
            return f"{module_name}.{path} is gone"
        target = getattr(target, part)
    return target


def _parameters(function: Callable[..., Any]) -> list[str]:
    names = [p.name for p in inspect.signature(function).parameters.values()]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _problems() -> list[str]:
    problems = []
    for module_name, path, parameters in _USED:
        found = _find(module_name, path)
        if isinstance(found, str):
            problems.append(found)
        elif parameters is not None and _parameters(found) != parameters:
            problems.append(f"{module_name}.{path} takes ({', '.join(_parameters(found))}), "
                            f"not ({', '.join(parameters)})")
    for module_name, class_name, attribute in _INSTANCE_ATTRIBUTES:
        found = _find(module_name, f"{class_name}.__init__")
        if isinstance(found, str):
            problems.append(found)
            continue
        try:
            source = inspect.getsource(found)
        except (OSError, TypeError):  # no source to read (a compiled install): nothing to check it against
            continue
        if f"self.{attribute} =" not in source:
            problems.append(f"{module_name}.{class_name}.__init__ sets no self.{attribute}")
    for module_name, class_name in BACKENDS.values():
        found = _find(module_name, f"{class_name}.build_graph_runner")
        if isinstance(found, str):
            if "does not import" not in found:  # a backend whose runtime (dlinfer) is absent cannot run anyway
                problems.append(found)
        elif _parameters(getattr(found, "__wrapped__", found)) != _BUILD_PARAMETERS:
            problems.append(f"{module_name}.{class_name}.build_graph_runner takes "
                            f"({', '.join(_parameters(found))}), not ({', '.join(_BUILD_PARAMETERS)})")
    return problems


def check_seam() -> str:
    """Check that what graphmode's runner uses in lmdeploy is there, with the
    parameters it passes; return lmdeploy's version. Raises SeamError naming
    the version and every piece that moved."""
    version = lmdeploy_version()
    problems = _problems()
    if problems:
        raise SeamError(
            f"lmdeploy {version} is not the shape graphmode's integration expects (written and run against lmdeploy "
            f"{', '.join(TESTED_VERSIONS)}): " + "; ".join(problems) + ". graphmode was not installed, and lmdeploy "
            f"would run its own graph runner: pin lmdeploy=={TESTED_VERSIONS[-1]}, or update graphmode"
        )
    return version


def installed() -> bool:
    """Whether graphmode builds lmdeploy's graph runners now."""
    return bool(_ORIGINALS)


def install(build: Callable[..., Any], settings: Any) -> list[str]:
    """Replace ``build_graph_runner`` of every importable lmdeploy op backend
    by one calling ``build(own_build, model, model_config, cache_config,
    backend_config, device)``, and make lmdeploy's worker processes enable
    graphmode with ``settings`` (``workers.py``); return the device types
    replaced. The seam is checked first; installing twice replaces nothing
    more (the settings are the last call's)."""
    from graphmode.integrations.lmdeploy.workers import ContextEnablingGraphmode

    check_seam()
    device_types = []
    for device_type, (module_name, class_name) in BACKENDS.items():
        backend = _find(module_name, class_name)
        if isinstance(backend, str):
            continue
        device_types.append(device_type)
        if (backend, "build_graph_runner") in _ORIGINALS:
            continue
        original = backend.__dict__["build_graph_runner"]

        def graphmode_build_graph_runner(model: Any, model_config: Any, cache_config: Any, backend_config: Any,
                                         device: Any, _own: Any = original.__func__) -> Any:
            return build(_own, model, model_config, cache_config, backend_config, device)

        graphmode_build_graph_runner.__wrapped__ = original.__func__  # type: ignore[attr-defined]
        _replace(backend, "build_graph_runner", staticmethod(graphmode_build_graph_runner))

    worker = _find(*WORKER_PROCESS)
    own_start = _ORIGINALS.get((worker, "start"), worker.start)

    def graphmode_start(self: Any, **kwargs: Any) -> Any:
        """lmdeploy's own start, its process enabling graphmode first."""
        context = self.mp_ctx
        self.mp_ctx = ContextEnablingGraphmode(context, settings)
        try:
            return own_start(self, **kwargs)
        finally:
            self.mp_ctx = context

    graphmode_start.__wrapped__ = own_start  # type: ignore[attr-defined]
    _replace(worker, "start", graphmode_start)
    return device_types


def _replace(owner: type, name: str, value: Any) -> None:
    _ORIGINALS.setdefault((owner, name), owner.__dict__[name])
    setattr(owner, name, value)


def uninstall() -> None:
    """Give lmdeploy its own methods back."""
    while _ORIGINALS:
        (owner, name), original = _ORIGINALS.popitem()
        setattr(owner, name, original)
