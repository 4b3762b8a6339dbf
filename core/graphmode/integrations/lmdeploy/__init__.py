"""lmdeploy's PyTorch engine with graphmode as its graph runner.

One call, before the engine is built::

    import graphmode.integrations.lmdeploy as gm_lmdeploy
    gm_lmdeploy.enable()                        # or enable(execute_mode="full_and_piecewise", debug=True)
    pipe = lmdeploy.pipeline(path, backend_config=PytorchEngineConfig(eager_mode=False))

From then on every graph runner lmdeploy builds in this process (the model
agent's, the speculative agent's, the memory-decode agent's) is a
:class:`LmdeployGraphRunner`: lmdeploy's decode steps replay graphmode's
graphs, built from the model's own ``CudaGraphMixin`` buffers by the vendor
that lmdeploy's device type names (cuda built in; camb and maca through
graphmode's plugins); prefill steps run lmdeploy's own way. lmdeploy's
models, attention, sampler, scheduler and cache are untouched.
``disable()`` gives lmdeploy its own runners back (for engines built later).
See docs/engines.md, "lmdeploy".
"""

from __future__ import annotations

import logging
from typing import Any

from graphmode.integrations.lmdeploy.seam import TESTED_VERSIONS, SeamError, check_seam, install, installed, uninstall

__all__ = ["TESTED_VERSIONS", "SeamError", "check_seam", "disable", "enable", "enabled"]

logger = logging.getLogger("graphmode.lmdeploy")

_settings: Any = None


def enable(execute_mode: str | None = None, debug: bool = False, vendor: str | None = None) -> list[str]:
    """Make graphmode build lmdeploy's graph runners from now on; returns the
    lmdeploy device types it builds them for.

    execute_mode: "graph" (the default: decode steps in graphmode's graphs),
        "full_and_piecewise" (the same; prefill steps run lmdeploy's own
        way, said at start-up) or "eager"; ``$GRAPHMODE_EXECUTE_MODE`` wins.
    debug: check every decode step's device values before its graph replays
        (one synchronisation a step); ``$GRAPHMODE_DEBUG`` wins.
    vendor: a graphmode vendor to use instead of the device type's.

    Raises SeamError, before changing anything, when the installed lmdeploy
    is not the shape this integration was written for.
    """
    global _settings
    check_seam()  # before runner.py imports what it uses of lmdeploy: a moved name is a SeamError, not an ImportError
    from graphmode.integrations.lmdeploy.runner import Settings

    _settings = Settings(execute_mode=execute_mode, debug=debug, vendor=vendor)
    return install(_build_graph_runner, _settings)


def disable() -> None:
    """lmdeploy builds its own graph runners again (engines built from now on)."""
    uninstall()


def enabled() -> bool:
    """Whether graphmode builds lmdeploy's graph runners now."""
    return installed()


def _build_graph_runner(own_build: Any, model: Any, model_config: Any, cache_config: Any, backend_config: Any,
                        device: Any) -> Any:
    """What a backend's ``build_graph_runner`` does while graphmode is enabled:
    lmdeploy's own runner, wrapped by graphmode's unless graph mode is off
    (``eager_mode=True``) or the device type is one graphmode leaves to lmdeploy."""
    from graphmode.integrations.lmdeploy.runner import NOT_TAKEN_OVER, LmdeployGraphRunner

    own = own_build(model, model_config=model_config, cache_config=cache_config, backend_config=backend_config,
                    device=device)
    if backend_config.eager_mode:
        return own
    device_type = backend_config.device_type
    if device_type in NOT_TAKEN_OVER:
        logger.warning("graphmode in lmdeploy: not taking over the %s graph runner: %s; lmdeploy's own runs",
                       device_type, NOT_TAKEN_OVER[device_type])
        return own
    return LmdeployGraphRunner(own, model, model_config, cache_config, backend_config, device, _settings)
