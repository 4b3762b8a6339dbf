"""The emulated NPU runtime of the Ascend plugin (graphmode_ascend.emulated_npu),
built on the core emulator's extension point: updatable calls
(torch_npu's NPUGraph.update), ACL task groups and task updates, and the
in-flight state of replays that a parameter update must wait for."""

from __future__ import annotations

import types

import pytest
import torch
from broken_plugins import _graph_skipping_the_wait  # the Ascend graph with its wait taken out
from setups import tiny_setup

import graphmode_ascend.plugin as ascend
from graphmode import CaptureError, ReplayError
from graphmode.emulator import EmulatedGraph
from graphmode_ascend import emulated_npu as npu
from graphmode_ascend.emulated_npu import register_updatable


# The schemas are written out (as torch 2.13 infers them): torch 2.5 infers
# none from ``list[int]``.
@torch.library.custom_op("graphmode_test::add_lengths", mutates_args=(), schema="(Tensor x, SymInt[] lengths) -> Tensor")
def add_lengths(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Adds host lengths to each row: a stand-in for an attention kernel that
    takes its kv lengths as host values."""
    return x + torch.tensor(lengths, dtype=x.dtype)[:, None]


@torch.library.custom_op(
    "graphmode_test::add_lengths_out", mutates_args=("out",), schema="(Tensor x, SymInt[] lengths, Tensor(a!) out) -> ()"
)
def add_lengths_out(x: torch.Tensor, lengths: list[int], out: torch.Tensor) -> None:
    out.copy_(x + torch.tensor(lengths, dtype=x.dtype)[:, None])


register_updatable(torch.ops.graphmode_test.add_lengths)


# -- updatable operators (torch_npu's NPUGraph.update) -----------------------


def _updatable_graph(rows: int = 2, calls: int = 2):
    x = torch.zeros(rows, 3)
    graph = npu.NPUGraph()
    graph.auto_dispatch_capture = True
    with graph.graph_dispatch_mode, graph.capture():
        outs = [torch.ops.graphmode_test.add_lengths(x, [1] * rows) for _ in range(calls)]
    return graph, x, outs


def test_update_replaces_host_arguments_of_every_updatable_operator():
    graph, x, (first, second) = _updatable_graph()
    assert graph.num_updatable == 2
    graph.update(cpu_update_input=[{"lengths": [5, 6]}])
    graph.replay()
    assert first[:, 0].tolist() == [5.0, 6.0] and second[:, 0].tolist() == [5.0, 6.0]
    npu.current_stream().synchronize()
    graph.update(cpu_update_input=[{"lengths": [1, 2]}, {"lengths": torch.tensor([3, 4])}])
    graph.replay()
    assert first[:, 0].tolist() == [1.0, 2.0] and second[:, 0].tolist() == [3.0, 4.0]


def test_replay_without_an_update_would_hang_and_raises():
    graph, _, _ = _updatable_graph()
    graph.update(cpu_update_input=[{"lengths": [5, 6]}])
    graph.replay()
    with pytest.raises(ReplayError, match="on the device this replay would hang"):
        graph.replay()


def test_update_errors_name_the_problem():
    graph, _, _ = _updatable_graph()
    with pytest.raises(ReplayError, match=r"update names \['kv_lens'\], which graphmode_test.add_lengths.default does not take; its arguments are \['lengths', 'x'\]"):
        graph.update(cpu_update_input=[{"kv_lens": [1, 1]}])
    with pytest.raises(ReplayError, match="update got 3 dicts for 2 captured updatable operators"):
        graph.update(cpu_update_input=[{}, {}, {}])
    plain = npu.NPUGraph()
    with plain.capture():
        torch.ones(1) + 1
    with pytest.raises(ReplayError, match="captured without auto_dispatch_capture"):
        plain.update(cpu_update_input=[{"lengths": [1]}])


def test_without_dispatch_capture_an_updatable_operator_is_frozen():
    x = torch.zeros(2, 1)
    graph = npu.NPUGraph()
    with graph.capture():
        y = torch.ops.graphmode_test.add_lengths(x, [1, 2])
    graph.replay()
    assert y[:, 0].tolist() == [1.0, 2.0] and graph.num_updatable == 0


# -- ACL task groups (older torch_npu) ---------------------------------------


def test_task_group_update_rewrites_the_captured_task():
    x, out = torch.zeros(2, 1), torch.zeros(2, 1)
    stream, update_stream = npu.current_stream(), npu.Stream()
    graph = npu.NPUGraph()
    with graph.capture():
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch.ops.graphmode_test.add_lengths_out(x, [1, 1], out)
        handle = npu.graph_task_group_end(stream)
        doubled = out * 2

    def push(lengths):
        with npu.stream(update_stream):
            npu.graph_task_update_begin(update_stream, handle)
            torch.ops.graphmode_test.add_lengths_out(x, lengths, out)
            npu.graph_task_update_end(update_stream)
            event.record(update_stream)

    push([7, 8])
    graph.replay()
    assert doubled[:, 0].tolist() == [14.0, 16.0]
    with pytest.raises(ReplayError, match="would hang"):
        graph.replay()
    stream.synchronize()
    push([1, 2])
    graph.replay()
    assert doubled[:, 0].tolist() == [2.0, 4.0]


def test_a_task_update_must_write_where_the_graph_reads():
    x, out = torch.zeros(2, 1), torch.zeros(2, 1)
    graph = npu.NPUGraph()
    with graph.capture():
        npu.graph_task_group_begin(npu.current_stream())
        torch.ops.graphmode_test.add_lengths_out(x, [1, 1], out)
        handle = npu.graph_task_group_end(npu.current_stream())
    npu.graph_task_update_begin(npu.Stream(), handle)
    try:
        with pytest.raises(ReplayError, match="allocates its result, which the captured graph never reads"):
            torch.ops.graphmode_test.add_lengths(x, [2, 2])
    finally:
        npu.graph_task_update_end(npu.Stream())


def test_task_groups_exist_only_inside_an_npu_graph_capture():
    with pytest.raises(CaptureError, match="graph_task_group_begin outside graph capture"):
        npu.graph_task_group_begin(npu.current_stream())
    graph = EmulatedGraph()
    with pytest.raises(CaptureError, match="task groups exist only in an NPU graph's capture"), graph.capture():
        npu.graph_task_group_begin(npu.current_stream())




# -- a replay stays in flight until something orders the update after it -------

IN_FLIGHT = "would change parameters the previous replay is still reading"


def _replayed_updatable_graph():
    graph, x, (first, _) = _updatable_graph()
    graph.update(cpu_update_input=[{"lengths": [5, 6]}])
    graph.replay()
    return graph, first


def test_an_update_while_the_previous_replay_is_in_flight_is_refused():
    graph, first = _replayed_updatable_graph()
    with pytest.raises(ReplayError) as error:
        graph.update(cpu_update_input=[{"lengths": [7, 8]}])
    assert str(error.value).startswith("NPUGraph.update on <emulated stream ")
    assert IN_FLIGHT + ": that replay was launched on <emulated stream " in str(error.value)
    assert "wait for the replay stream before updating" in str(error.value)
    assert first[:, 0].tolist() == [5.0, 6.0]  # the refused update changed nothing


@pytest.mark.parametrize(
    "wait",
    [
        lambda replay_stream, update_stream: replay_stream.synchronize(),
        lambda replay_stream, update_stream: npu.synchronize(),
        lambda replay_stream, update_stream: update_stream.wait_stream(replay_stream),
        lambda replay_stream, update_stream: update_stream.wait_event(replay_stream.record_event()),
        lambda replay_stream, update_stream: replay_stream.record_event().synchronize(),
    ],
    ids=["stream.synchronize", "synchronize", "wait_stream", "wait_event", "event.synchronize"],
)
def test_every_way_of_ordering_the_update_after_the_replay_lets_it_run(wait):
    graph, first = _replayed_updatable_graph()
    wait(npu.current_stream(), npu.GraphDispatchMode.update_stream)
    graph.update(cpu_update_input=[{"lengths": [7, 8]}])
    graph.replay()
    assert first[:, 0].tolist() == [7.0, 8.0]


def test_an_event_recorded_before_the_replay_does_not_order_the_update_after_it():
    graph, _, _ = _updatable_graph()
    stream, update_stream = npu.current_stream(), npu.GraphDispatchMode.update_stream
    early = stream.record_event()
    graph.update(cpu_update_input=[{"lengths": [5, 6]}])
    graph.replay()
    update_stream.wait_event(early)
    with pytest.raises(ReplayError, match=IN_FLIGHT):
        graph.update(cpu_update_input=[{"lengths": [7, 8]}])


def test_a_task_update_while_the_previous_replay_is_in_flight_is_refused():
    x, out = torch.zeros(2, 1), torch.zeros(2, 1)
    stream, update_stream = npu.current_stream(), npu.Stream()
    graph = npu.NPUGraph()
    with graph.capture():
        npu.graph_task_group_begin(stream)
        torch.ops.graphmode_test.add_lengths_out(x, [1, 1], out)
        handle = npu.graph_task_group_end(stream)
    graph.replay()
    with pytest.raises(ReplayError, match=f"^graph_task_update_begin on <emulated stream .*{IN_FLIGHT}"):
        npu.graph_task_update_begin(update_stream, handle)
    update_stream.wait_stream(stream)
    npu.graph_task_update_begin(update_stream, handle)
    torch.ops.graphmode_test.add_lengths_out(x, [4, 4], out)
    npu.graph_task_update_end(update_stream)
    graph.replay()
    assert out[:, 0].tolist() == [4.0, 4.0]


def _ascend_variant(name: str, **changes) -> types.SimpleNamespace:
    plugin = types.SimpleNamespace(__name__=name)
    for attr in dir(ascend):
        if attr.startswith("graphmode_"):
            setattr(plugin, attr, getattr(ascend, attr))
    for attr, function in changes.items():
        setattr(plugin, attr, function)
    return plugin


PATHS = ["graph_update", "task_group"]


@pytest.mark.parametrize("path", PATHS)
def test_the_ascend_graph_waits_for_the_previous_replay_before_pushing_kv_lengths(path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    for _ in range(4):  # a capture, then replays each pushing kv lengths
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.replays == 3


@pytest.mark.parametrize("path", PATHS)
def test_the_kv_length_update_waits_on_an_event_and_the_host_never_waits(path, monkeypatch):
    """The update is ordered after the previous replay on the device (the
    update stream waits on an event recorded after it), not by a host
    synchronisation: every replay stays in flight on the replay stream, and
    the refusal of an unordered update (the test below) does not fire."""
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    setup.decode(seqs)  # the capture
    stream = npu.current_stream()
    done, launched = stream.done, stream.launched
    for _ in range(3):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.replays == 3
    assert stream.launched == launched + 3
    assert stream.done == done, "the host waited for a replay (a synchronisation before the length update)"


@pytest.mark.parametrize("path, where", [("graph_update", "NPUGraph.update"), ("task_group", "graph_task_update_begin")])
def test_an_ascend_graph_that_skips_the_wait_is_refused_on_its_second_replay(path, where, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", path)
    plugin = _ascend_variant("skips_the_wait", graphmode_make_graph=_graph_skipping_the_wait)
    setup = tiny_setup("ascend", plugin=plugin)
    seqs = setup.prefill(3, [2, 9, 17])
    setup.decode(seqs)  # the capture
    setup.decode(seqs)  # the first replay: no replay before it
    with pytest.raises(ReplayError, match=f"^{where} on <emulated stream .*{IN_FLIGHT}"):
        setup.decode(seqs)
