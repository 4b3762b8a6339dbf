"""The native steady-state step (graphmode.native): after the Python path
took a replay step of a layout, later steps of that layout run in C++ with
the same result, and any step it cannot prove the same goes back to the
Python path, whose checks and errors it keeps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import hangs
import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode.errors import InputError
from graphmode.native import native_module

# Skipped only where nothing can build it; where a compiler is, a build failure fails the tests.
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")


def test_the_native_step_builds_here():
    assert native_module() is not None, "graphmode.native could not be built; see the graphmode logger's INFO record"


# A child process whose build is torch's load replaced by a copy of the module
# this process has (argv: that module, seconds the "build" takes), so that the
# build's locking and caching are tested without compiling.
_FAKE_BUILD = """
import importlib.util, pathlib, shutil, sys, time
import torch.utils.cpp_extension as ext
built = pathlib.Path(sys.argv[1])
def load(name, sources, build_directory, **kwargs):
    if float(sys.argv[2]) < 0:
        raise AssertionError("built again")
    with open(pathlib.Path(build_directory).parent.parent / "builds.txt", "a") as log:
        log.write("built\\n")
    time.sleep(float(sys.argv[2]))
    shutil.copy(built, pathlib.Path(build_directory) / built.name)
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(build_directory) / built.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
ext.load = load
from graphmode.native import native_module
assert native_module() is not None, "no native module"
"""


def _built_module() -> Path:
    """The module this process loaded, where the native step keeps it."""
    assert native_module() is not None
    return graphmode.native.native_dir() / graphmode.native.build_key() / "graphmode_native_step.so"


def _fake_build(home: Path, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _FAKE_BUILD, str(_built_module()), str(seconds)],
                            env={**os.environ, graphmode.native.ENV_NATIVE_DIR: str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(child: subprocess.Popen) -> str:
    try:
        _, stderr = child.communicate(timeout=300)  # a hang here is a lock never released
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError("a native-step build process ran past its 300 s timeout (a hang?)") from None
    assert child.returncode == 0, stderr[-3000:]
    return stderr


def _said_by_graphmode(stderr: str) -> list[str]:
    """stderr's lines less torch's own: a CUDA build of torch on a machine
    without a GPU logs "No CUDA runtime is found" when its C++ extension
    module is imported (with its logger's prefix on torch 2.15, bare on
    2.5), which every child here does."""
    return [line for line in stderr.splitlines() if line.strip() and "No CUDA runtime is found" not in line]


def test_processes_build_the_module_once_and_say_so_once(tmp_path):
    """Two processes starting at once on an empty cache: one builds (one line
    on stderr says so), the other waits for its module; a later process loads
    it without building (the fake build raises if asked)."""
    first, second = _fake_build(tmp_path, 2), _fake_build(tmp_path, 2)
    said = _finish(first) + _finish(second)
    assert (tmp_path / "builds.txt").read_text().splitlines() == ["built"]
    assert said.count("graphmode: building the native replay step") == 1, said
    assert len(_said_by_graphmode(said)) == 1, said
    assert _said_by_graphmode(_finish(_fake_build(tmp_path, -1))) == []


def test_the_build_key_names_what_the_module_was_built_against_not_where(monkeypatch):
    """An environment with the same torch shares the module: its key holds no
    path (a second virtual environment has another sys.prefix and torch path)."""
    key = graphmode.native.build_key()
    assert torch.__version__ in key
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/torch/__init__.py")
    assert graphmode.native.build_key() == key


def test_a_build_killed_mid_way_does_not_hang_the_next_one(tmp_path):
    """PyTorch's build lock is a file its baton waits on forever: a build killed
    before removing it hung every later process at its first replay. A build
    holds an OS lock (dropped when its process dies) and builds in a new
    directory, so the next process builds; a live build is waited for."""
    from graphmode.native import _build_lock

    home = tmp_path / graphmode.native.build_key()
    killed = ("import os, pathlib, sys; from graphmode.native import _build_lock; d = pathlib.Path(sys.argv[1])\n"
              "d.mkdir(parents=True)\n"
              "with _build_lock(d):\n    (d / 'build-killed').mkdir(); (d / 'build-killed' / 'lock').touch(); os._exit(1)")
    hangs.run([sys.executable, "-c", killed, str(home)], ci_seconds=3)
    assert (home / "build-killed" / "lock").exists()  # what a killed build leaves
    _finish(_fake_build(tmp_path, 0))
    assert (home / "graphmode_native_step.so").exists() and not (home / "build-killed").exists()
    live = ("import pathlib, sys, time; from graphmode.native import _build_lock; d = pathlib.Path(sys.argv[1])\n"
            "with _build_lock(d):\n    print('held', flush=True); time.sleep(0.5); (d / 'done').touch()")
    child = subprocess.Popen([sys.executable, "-c", live, str(home)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    with _build_lock(home):
        assert (home / "done").exists()  # waited for the live build
    assert child.wait(hangs.bound(3)) == 0


_seen: dict[int, int] = {}


def _native_replays(runner) -> int:
    """Replays the native step made since the last look."""
    memo = runner.family("full").native.memo
    now, before = memo.replays, _seen.get(id(memo), 0)
    _seen[id(memo)] = now
    return now - before


def _learned(steps: int = 3, **options):
    """A runner (buckets 4 and 8) after ``steps`` decode steps of 3 of 4
    prefilled sequences: a capture, then Python replays that teach the memo."""
    setup = tiny_setup(max_batches=8, capture_batch_sizes=[4, 8], **options)
    seqs = setup.prefill(4)
    for _ in range(steps):
        graph, eager = setup.decode(seqs[:3])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    return setup, seqs


@pytest.mark.parametrize("host_inputs", [False, True], ids=["device inputs", "host staging"])
def test_steady_state_steps_run_natively_and_equal_eager(host_inputs):
    setup = tiny_setup(max_batches=8, host_inputs=host_inputs, capture_batch_sizes=[4, 8])
    seqs = setup.prefill(8)
    for _ in range(2):  # capture, then the Python replay that teaches the memo (every host mirror at once)
        graph, eager = setup.decode(seqs[:3])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert (setup.runner.staging is not None) == host_inputs
    _native_replays(setup.runner)
    for batch in (3, 3, 3, 3, 3, 3, 3, 3, 3):  # past every mirror twice
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert _native_replays(setup.runner) == 9
    assert setup.caches_close()
    # Other batch sizes and buckets: each layout taught once, then native.
    for batch in (7, 7, 7, 8, 8, 8, 3, 7, 8):
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert _native_replays(setup.runner) >= 3
    assert setup.caches_close()


def test_native_replays_count_in_the_statistics_as_they_run():
    """An engine may keep ``runner.stats`` and read it later: it counts every replay at once."""
    setup = tiny_setup(max_batches=8, capture_batch_sizes=[4, 8])
    stats = setup.runner.stats
    seqs = setup.prefill(4)
    for _ in range(6):
        setup.decode(seqs[:3])
    assert _native_replays(setup.runner) == 4
    assert (stats.captures, stats.replays, stats.replays_by_q_len[1]) == (1, 5, 5), stats.summary()
    assert stats.replays_by_variant == {"plain": 5}
    assert (stats.real_tokens, stats.padded_tokens) == (18, 6)


def test_a_step_it_cannot_prove_the_same_gets_the_python_paths_error():
    setup, seqs = _learned(4)
    assert len(setup.runner.family("full").native.memo) == 1
    step = setup.engine.decode(seqs[:3])
    # A KV-cache tensor replaced by another of the same shape: the graph would write the old one.
    layer = list(setup.graph_cache[0])
    layer[0] = layer[0].clone()
    other = [tuple(layer), *setup.graph_cache[1:]]
    with torch.inference_mode(), pytest.raises(InputError, match="past_key_values"):
        setup.runner(step.input_ids, step.position_ids, other, step.attn_metadata)
    # A maximum past the block table: the Python path's check names it.
    too_long = step.attn_metadata.replace(max_kv_seq_len=setup.runner.config.max_blocks_per_seq * 16 + 1)
    with torch.inference_mode(), pytest.raises(InputError, match="max_kv_seq_len"):
        setup.runner(step.input_ids, step.position_ids, setup.graph_cache, too_long)
    # A float position tensor: another layout, checked whole.
    with torch.inference_mode(), pytest.raises(InputError, match="position_ids"):
        setup.runner(step.input_ids, step.position_ids.float(), setup.graph_cache, step.attn_metadata)


def test_a_strided_step_of_the_same_sizes_takes_the_python_path_and_equals_eager():
    """Strides are not part of the layout; the int64-as-int32-words copy needs a
    contiguous last dimension, so the native step declines such a step."""
    setup, seqs = _learned(3)
    _native_replays(setup.runner)
    step = setup.engine.decode(seqs[:3])
    wide = torch.stack([step.input_ids, step.input_ids], dim=-1)[..., 0]  # (1, 3), last-dimension stride 2
    assert wide.stride(-1) == 2
    with torch.inference_mode():
        graph = setup.runner(wide, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert _native_replays(setup.runner) == 0


def test_reset_forgets_the_memo_and_steps_learn_again():
    setup, seqs = _learned(3)
    assert len(setup.runner.family("full").native.memo) == 1
    assert _native_replays(setup.runner) == 1
    setup.runner.reset()
    assert len(setup.runner.family("full").native.memo) == 0
    for _ in range(4):
        graph, eager = setup.decode(seqs[:3])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert _native_replays(setup.runner) == 2
    assert setup.runner.stats.captures == 2


def test_a_second_thread_is_refused_while_a_native_step_runs():
    """The native step holds the runner's one-step lock, as the Python path does."""
    setup, seqs = _learned(3)
    step = setup.engine.decode(seqs[:3])
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with setup.runner._busy:
            holding.set()
            hangs.wait(release, "the test releasing the runner's lock")

    thread = threading.Thread(target=hold)
    thread.start()
    hangs.wait(holding, "the thread taking the runner's lock")
    try:
        with torch.inference_mode(), pytest.raises(InputError, match="another call is running"):
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    finally:
        release.set()
        hangs.join(thread, "the thread holding the runner's lock")


def test_runners_the_native_step_does_not_take(monkeypatch):
    """Debug mode and graph variants keep the Python path (their per-step work
    is Python's); GRAPHMODE_NATIVE=0 turns it off."""
    setup = tiny_setup(max_batches=8, capture_batch_sizes=[4, 8], debug=True)
    seqs = setup.prefill(4)
    for _ in range(3):
        setup.decode(seqs[:3])
    assert setup.runner.family("full").native is None
    assert native_module() is not None
    monkeypatch.setenv(graphmode.native.ENV_NATIVE, "0")  # read at every call
    assert native_module() is None
    setup = tiny_setup(max_batches=8, capture_batch_sizes=[4, 8])
    seqs = setup.prefill(4)
    for _ in range(3):
        graph, eager = setup.decode(seqs[:3])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.runner.family("full").native is None
    monkeypatch.delenv(graphmode.native.ENV_NATIVE)
    assert native_module() is not None  # switched off for a while, not for the rest of the process


def test_host_inputs_the_runner_copies_to_the_device_are_not_learned():
    """Without host staging, host inputs are copied to the device before the
    fill: the step the fill read is not the engine's, so the memo keeps
    nothing (it would learn the copy's layout at every step, and never match)."""
    setup = tiny_setup(max_batches=8, host_inputs=True, capture_batch_sizes=[4, 8], host_staging=False)
    seqs = setup.prefill(4)
    for _ in range(4):
        graph, eager = setup.decode(seqs[:3])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    native = setup.runner.family("full").native
    assert native is None or len(native.memo) == 0
    assert setup.runner.stats.replays == 3
