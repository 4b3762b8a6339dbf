"""The native steady-state step: a replay step the Python path decided once,
repeated in C++ (``step.cpp``).

A served decode loop repeats one step layout (the same tensor shapes, dtypes
and devices) thousands of times. The Python path decides what a step of a
layout does (its checks, the fill's copies, the graph, the output view) and
makes that decision once per layout, but every call still walks it in
Python: tens of microseconds of host time, more than the copy and the
launch themselves. :class:`NativeSteps` remembers each replay step the
Python path took and, for a later step of the same layout, does the same
in C++: it checks what can differ from step to step (every tensor's sizes,
dtype and device; the usual decode's host maxima; the KV cache's tensors
and addresses; the addresses of the model's parameters and buffers the
graphs captured, ``Addresses``; on the emulator, which tensors are host
memory), then runs
the same copies, the same replay and returns the same output view. Any
difference, and it returns None without an effect: the Python path takes
the step, with its checks and errors. So errors exist once, in Python.

It takes the steps of full graphs that the built-in buffer hooks fill, with
no graph variants, debug mode, per-step rank agreement, extras, or host
lengths beside an unknown maximum: the usual decode step. Everything else
keeps the Python path. (The host-read guard, ``graphmode.checks.host_reads``,
watches vendor hooks, which a native step never calls.)

Built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja), once per torch build and Python ABI: the module lands in
``~/.cache/graphmode`` (``$GRAPHMODE_NATIVE_DIR``) under a key of what it was
built against, and every environment with that torch loads it from there
without asking ninja (whose build file names one environment's include
paths, so two environments took turns rebuilding it). Where it cannot be
built, or with ``GRAPHMODE_NATIVE=0``, every step takes the Python path: the
same results, more host time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import operator
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphmode.context import REQUIRED_TENSORS, STEP_PATHS, AttnMetadata, StepInputs
from graphmode.emulator.host import is_host

if TYPE_CHECKING:
    from graphmode.buffers import FillPlan
    from graphmode.families.full import CapturedGraph
    from graphmode.families.stats import FamilyStats
    from graphmode.spec import BufferSpec
    from graphmode.staging import HostStaging

__all__ = ["ENV_NATIVE", "ENV_NATIVE_DIR", "NativeSteps", "build_key", "native_dir", "native_module"]

ENV_NATIVE = "GRAPHMODE_NATIVE"
ENV_NATIVE_DIR = "GRAPHMODE_NATIVE_DIR"
_NAME = "graphmode_native_step"
_CFLAGS = ("-O2",)
# The file name torch's load gives a module it builds (cpp_extension.LIB_EXT).
_LIB_SUFFIX = ".pyd" if sys.platform == "win32" else ".so"
_SEQUENCES = (list, tuple)
logger = logging.getLogger("graphmode")
_SOURCE = Path(__file__).with_name("step.cpp")


def native_module() -> Any | None:
    """The compiled module, loaded once per process and built once per torch
    build (:func:`build_key`), or None where it is off (``$GRAPHMODE_NATIVE``
    is 0, read at every call) or cannot be built."""
    if os.environ.get(ENV_NATIVE, "").strip() == "0":
        return None  # not remembered: a process that turns it off for a while gets it back after
    return _loaded_module()


@functools.cache
def _loaded_module() -> Any | None:
    """:func:`native_module` once switched on: loaded (or found unbuildable) once per process."""
    try:
        return _load(native_dir() / build_key())
    except Exception as error:  # no compiler, no ninja, a read-only home: the Python path
        logger.info("graphmode: the native replay step could not be built (%s); every step takes the Python path",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None


def native_dir() -> Path:
    """Where built modules are kept: ``$GRAPHMODE_NATIVE_DIR``, else ``~/.cache/graphmode``."""
    return Path(os.environ.get(ENV_NATIVE_DIR) or Path.home() / ".cache" / "graphmode")


def build_key() -> str:
    """The name of the directory of the module built for this process: the
    torch release, a digest of what the module's binary depends on (torch's
    build and C++ ABI, the Python ABI, step.cpp, the flags), never of where
    torch is installed. Two environments with the same torch share it."""
    parts = [
        torch.__version__, str(torch.version.git_version), str(torch._C._GLIBCXX_USE_CXX11_ABI),
        str(torch.version.cuda), str(torch.version.hip), sys.implementation.cache_tag,
        str(sysconfig.get_config_var("EXT_SUFFIX")), platform.machine(), os.environ.get("CXX", ""),
        " ".join(_CFLAGS), hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"native-torch{torch.__version__}-{sys.implementation.cache_tag}-{digest}"


def _load(home: Path) -> Any:
    """The module from ``home``, built there first when it is not: by one
    process at a time (an OS lock), the others waiting for its module."""
    built = home / f"{_NAME}{_LIB_SUFFIX}"
    if not built.exists():
        home.mkdir(parents=True, exist_ok=True)
        with _build_lock(home):
            if not built.exists():  # else another process built it while this one waited
                for dead in home.glob("build-*"):  # killed builds': a live one would hold the lock
                    shutil.rmtree(dead, ignore_errors=True)
                return _build(home, built)
    spec = importlib.util.spec_from_file_location(_NAME, built)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {built}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(home: Path, built: Path) -> Any:
    """Build the module in a directory of its own under ``home`` and move it
    to ``built`` once it imported, so that no process finds half a module;
    the module torch's ``load`` imported is this process's."""
    from torch.utils.cpp_extension import load

    print(f"graphmode: building the native replay step for torch {torch.__version__} (once per torch build, "
          f"about half a minute; kept in {home})", file=sys.stderr, flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=home))
    try:
        with _ninja_on_path():
            module = load(name=_NAME, sources=[str(_SOURCE)], build_directory=str(scratch),
                          extra_cflags=list(_CFLAGS), verbose=False)
        os.replace(scratch / built.name, built)
        return module
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(home: Path) -> Iterator[None]:
    """Hold an OS lock on ``home`` while building there: one build at a time,
    and a process killed mid-way drops it (PyTorch's own lock is a file that
    its baton waits on forever when a killed build leaves it: each build has
    a new directory, so no later one finds that file)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the final rename alone keeps half a module out of reach
        yield
        return
    with open(home / "graphmode.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """PyTorch runs ``ninja`` from $PATH: the pip package's (a dependency)
    is not on it when the environment's Python runs without its bin/
    directory there, so add it while building."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


class NativeSteps:
    """A runner's memo of full-graph replay steps (see the module's doc).

    ``step(...)`` is the memo's: the output of a remembered step, or None;
    it counts its replays in ``stats`` as the Python path does. :meth:`learn`
    is called by the Python path after each replay step it took;
    :meth:`clear` on every capture and reset. ``addresses``: the module's
    ``Addresses`` of the captured parameters and buffers
    (``graphmode.checks.weight_memory.WeightMemory.addresses``), or None:
    a step where one moved goes to the Python path, which refuses it."""

    def __init__(self, module: Any, lock: Any, staging: HostStaging | None, emulated: bool, limits: tuple[int, int],
                 stats: FamilyStats, variant: str, addresses: Any = None) -> None:
        marks = (lambda tensors: tuple(map(is_host, tensors))) if emulated else None
        self.memo = module.Memo(AttnMetadata, list(REQUIRED_TENSORS), lock, staging, marks, stats, variant, addresses)
        self.step = self.memo.step
        self._marks = marks
        self._staging = staging
        self._max_blocks, self._block_size = limits

    def learn(self, captured: CapturedGraph, inputs: StepInputs, batch: int, plan: FillPlan | None,
              output: Any) -> None:
        """Remember the replay step just taken, when it is the usual decode
        step and its fill is one the memo can repeat (``plan``: the fill's
        ``FillPlan``, or None; ``output``: the output view every step of this
        batch size aliases, or None)."""
        attn = inputs.attn_metadata
        if inputs.extras or type(attn) is not AttnMetadata or attn.is_decoding is not True \
                or type(attn.max_q_seq_len) is not int or attn.max_q_seq_len != 1 \
                or type(attn.max_kv_seq_len) is not int or inputs.num_tokens != batch \
                or (attn.max_kv_seq_len < 0 and attn.kv_seqlens_cpu is not None) \
                or captured.extras or plan is None or not isinstance(output, torch.Tensor):
            return
        kv_limit = min(self._max_blocks, attn.block_offsets.shape[-1]) * self._block_size
        if attn.max_kv_seq_len > kv_limit:
            return
        tensors = [inputs.input_ids, inputs.position_ids, *(getattr(attn, name) for name in REQUIRED_TENSORS)]
        program = _program(plan, tensors)
        # step.cpp walks a list or tuple of per-layer lists or tuples, as cache_checks chains them.
        cache, leaves = inputs.past_key_values, captured.memory.leaves
        if program is None or type(cache) not in _SEQUENCES or any(type(layer) not in _SEQUENCES for layer in cache):
            return
        now = [tensor for layer in cache for tensor in layer]
        if len(now) != len(leaves) or not all(map(operator.is_, now, leaves)) \
                or not all(isinstance(t, torch.Tensor) for t in leaves):
            return
        graph = captured.graph
        inner = getattr(graph, "graph", None)
        replay = inner.replay if inner is not None and type(graph).replay is _torch_graph_replay() else graph.replay
        staging = self._staging
        marks = self._marks(tensors) if self._marks is not None else None
        if staging is None:
            self.memo.learn(inputs.input_ids, inputs.position_ids, attn, batch, captured.bucket, kv_limit,
                            list(leaves), 0, program, replay, output, marks, None)
            return
        # With host staging, the step's copies for every mirror at once: the fill plan
        # puts each buffer's rows at the same place of whichever mirror is the step's.
        for slot in range(len(staging.mirrors)):
            copies = [([staging.in_mirror(d, slot) for d in destinations], sources, constants)
                      for destinations, sources, constants in program]
            self.memo.learn(inputs.input_ids, inputs.position_ids, attn, batch, captured.bucket, kv_limit,
                            list(leaves), slot, copies, replay, output, marks, staging.copy_views(slot, captured.bucket))

    @property
    def replays(self) -> int:
        """Replays the memo made (a bench's check that its timed calls took the native step)."""
        return int(self.memo.replays)

    def clear(self) -> None:
        self.memo.clear()


def _program(plan: FillPlan, tensors: list[torch.Tensor]) -> list[tuple[list, list, list]] | None:
    """The copies a fill plan (``graphmode.buffers.FillPlan``) made for the step
    whose tensors (``STEP_PATHS`` order) are ``tensors``, as step.cpp takes
    them: per ``_foreach_copy_``, (destinations, (index into ``tensors``,
    copied as int32 words) per step source, constants). None when a source
    is not one of those tensors as given (a function source, a choice
    between paths)."""
    def index(spec: BufferSpec) -> int | None:
        if callable(spec.source) or len(spec.sources) != 1 or spec.sources[0] not in STEP_PATHS:
            return None
        return STEP_PATHS.index(spec.sources[0])

    program: list[tuple[list, list, list]] = []
    groups: list[Any] = plan.groups
    words = plan.words
    if words is not None:
        found = [(index(getter[2]), wide) for getter, wide in words.getters]
        usable = all(i is not None and tensors[i].dtype is (torch.int64 if wide else torch.int32)
                     and (not wide or (tensors[i].dim() > 0 and tensors[i].stride(-1) == 1)) for i, wide in found)
        if usable:  # the plan took its one copy of words (graphmode.fill_words)
            program.append((words.destinations, found, words.constants))
            groups = plan.others
    for destinations, getters, constants in groups:
        program.append((destinations, [(index(getter[2]), False) for getter in getters], constants))
    if any(i is None for _, sources, _ in program for i, _ in sources):
        return None
    return program


@functools.cache
def _torch_graph_replay() -> Any:
    from graphmode.graphs.torch_graph import TorchGraph

    return TorchGraph.replay
