"""The CPU graph emulator: what it refuses, what it freezes, and that stale
vendor behaviour gives wrong output exactly as on a device. (Ascend's
emulated NPU runtime, built on it, is tested in test_ascend_emulator.py.)"""

from __future__ import annotations

import pytest
import torch
from emulated_updates import HostListGraph, UpdatableAddGraph, paged_decode
from setups import tiny_setup

import graphmode
from graphmode import CaptureError, ReplayError
from graphmode.attention import ReferenceAttentionOps
from graphmode.emulator import EmulatedGraph, mark_host

# -- host reads inside capture are refused -----------------------------------


@pytest.mark.parametrize(
    "read, named",
    [
        (lambda x: x.tolist(), "Tensor.tolist()"),
        (lambda x: x.sum().item(), "Tensor.item()"),
        (lambda x: print(x), "Tensor.__repr__()"),
        (lambda x: f"{x}", "Tensor.__format__()"),
        (lambda x: x.cpu(), "Tensor.cpu()"),
        (lambda x: x.to("cpu"), "Tensor.to()"),
        (lambda x: bool(x.sum() > 0), "Tensor.__bool__()"),
        (lambda x: torch.nonzero(x), "aten.nonzero.default"),
        (lambda x: x[x > 1], "aten.index.Tensor with a boolean mask"),
        (lambda x: x.masked_select(x > 1), "aten.masked_select.default"),
        (lambda x: x.unique(), "aten._unique2.default"),
    ],
)
def test_host_reads_of_device_memory_fail_capture_naming_op_and_call_site(read, named):
    x = torch.arange(4.0)
    graph = EmulatedGraph()
    with pytest.raises(CaptureError) as error:
        with graph.capture():
            read(x)
    message = str(error.value)
    assert named in message or named in str(error.value.__cause__)
    assert "test_emulator.py" in message + str(error.value.__cause__)


def test_the_call_site_is_named_when_the_caller_lives_under_a_directory_named_torch(tmp_path):
    # An environment installed at /opt/torch puts transformers at
    # /opt/torch/lib/.../transformers: its lines are the caller's, not torch's.
    package = tmp_path / "torch" / "lib" / "site-packages"
    package.mkdir(parents=True)
    (package / "a_model_file.py").write_text("def forward(x):\n    return x.tolist()\n")
    namespace: dict = {}
    exec(compile((package / "a_model_file.py").read_text(), str(package / "a_model_file.py"), "exec"), namespace)
    graph = EmulatedGraph()
    with pytest.raises(CaptureError) as error:
        with graph.capture():
            namespace["forward"](torch.arange(4.0))
    assert f"{package / 'a_model_file.py'}:2 in forward" in str(error.value) + str(error.value.__cause__)


def test_a_caught_capture_error_still_invalidates_the_capture():
    x = torch.arange(4.0)
    graph = EmulatedGraph()
    graph.capture_begin()
    with pytest.raises(CaptureError):
        x.sum().item()
    with pytest.raises(CaptureError, match="the capture was invalidated by an earlier error"):
        graph.capture_end()
    with pytest.raises(CaptureError, match="this graph is invalidated; call reset"):
        graph.capture_begin()
    graph.reset()
    with graph.capture():
        y = x + 1
    graph.replay()
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_host_memory_may_be_read_and_is_frozen():
    lengths = mark_host(torch.tensor([3, 4]))
    x = torch.zeros(2)
    graph = EmulatedGraph()
    with graph.capture():
        y = x + lengths.sum().item()
    lengths.fill_(100)
    graph.replay()
    assert y.tolist() == [7.0, 7.0]


# -- operator coverage -------------------------------------------------------


def test_multi_output_and_in_place_view_operators_replay_correctly():
    x = torch.tensor([[1.0, 5.0], [7.0, 2.0]])
    graph = EmulatedGraph()
    with graph.capture():
        values, indices = x.max(dim=1)
        column = (x @ torch.ones(2)).unsqueeze(1)
        column.squeeze_(1)
        flat = x.reshape(-1).contiguous()
    x.copy_(torch.tensor([[9.0, 0.0], [3.0, 4.0]]))
    graph.replay()
    assert values.tolist() == [9.0, 4.0] and indices.tolist() == [0, 1]
    assert column.tolist() == [9.0, 7.0] and flat.tolist() == [9.0, 0.0, 3.0, 4.0]


def test_out_arguments_write_into_the_recorded_tensor():
    x, out = torch.ones(3), torch.empty(3)
    graph = EmulatedGraph()
    with graph.capture():
        torch.mul(x, 3, out=out)
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [6.0, 6.0, 6.0]


def test_nested_captures_are_refused():
    outer, inner = EmulatedGraph(), EmulatedGraph()
    with outer.capture():
        with pytest.raises(CaptureError, match="another graph is capturing in this thread"):
            inner.capture_begin()


def test_replay_of_an_empty_graph_is_refused():
    with pytest.raises(ReplayError, match="replay of a graph that is empty; capture it first"):
        EmulatedGraph().replay()


def test_pool_shares_ownership_of_captured_memory():
    x = torch.zeros(256)
    first, second = EmulatedGraph(), EmulatedGraph()
    with first.capture():
        y = x * 2
    with second.capture(pool=first.pool()):
        z = y + 1
    pool = first.pool()
    assert second.pool() is pool and pool.num_graphs == 2
    assert pool.nbytes() == 2 * 256 * 4
    first.reset()
    assert pool.num_graphs == 1 and pool.nbytes() == 256 * 4
    del z


def test_debug_dump_lists_the_recorded_operators(tmp_path):
    x = torch.ones(2, 2)
    graph = EmulatedGraph()
    with graph.capture():
        (x.t() @ x).relu()
    path = tmp_path / "graph.txt"
    graph.debug_dump(str(path))
    lines = path.read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["skip", "replay", "replay"]
    assert "aten.mm.default(float32[2, 2], float32[2, 2]) -> float32[2, 2]" in lines[1]


# -- stale vendor behaviour gives wrong output, as on a device ---------------


class HonoursMaxLength(ReferenceAttentionOps):
    """A kernel that, like Cambricon's, reads only max_kv_seq_len tokens when
    it is positive."""

    def _decode_limit(self, attn):
        limit = attn.kv_seqlens[:, None]
        return limit.clamp(max=attn.max_kv_seq_len) if attn.max_kv_seq_len > 0 else limit


class MaxLengthFromTheHost:
    """Stale: passes the step's real max length into the graph context,
    where the capture freezes it."""

    @graphmode.hookimpl
    def graphmode_attention_ops(self):
        return HonoursMaxLength()

    @graphmode.hookimpl(wrapper=True)
    def graphmode_update_context(self, meta, inputs, batch_size, bucket):
        static = yield
        static.attn_metadata.max_kv_seq_len = inputs.attn_metadata.max_kv_seq_len
        return static


class MaxLengthDynamic(MaxLengthFromTheHost):
    """Right: keeps the default -1 ("derive from kv_seqlens")."""

    @graphmode.hookimpl(wrapper=True)
    def graphmode_update_context(self, meta, inputs, batch_size, bucket):
        return (yield)


class LengthsNotRefilled:
    """Stale: never refills kv_seqlens after the first step."""

    @graphmode.hookimpl(wrapper=True)
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        keep = meta.input_buffers["kv_seqlens"].clone()
        result = yield
        if meta.vendor_state.setdefault("filled_once", False):
            meta.input_buffers["kv_seqlens"].copy_(keep)
        meta.vendor_state["filled_once"] = True
        return result


def _max_error(plugin, steps=6):
    setup = tiny_setup(type(plugin).__name__, plugin=plugin)
    seqs = setup.prefill(4, [3, 5, 6, 2])
    worst = 0.0
    for _ in range(steps):
        graph, eager = setup.decode(seqs)
        worst = max(worst, (graph - eager).abs().max().item())
    return worst


def test_a_max_length_frozen_at_capture_gives_wrong_output():
    assert _max_error(MaxLengthDynamic()) < 1e-5
    assert _max_error(MaxLengthFromTheHost()) > 1e-3


def test_a_buffer_not_refilled_gives_wrong_output():
    assert _max_error(LengthsNotRefilled()) > 1e-3


# -- the extension point: an updatable operator (docs/emulator.md) -------------


def test_an_updatable_operator_on_the_extension_point():
    # --8<-- [start:updatable_use]
    x = torch.ones(3)
    graph = UpdatableAddGraph()
    with torch.inference_mode(), graph.capture():
        y = torch.add(x, x, alpha=2) * 10  # the add is updatable, the mul an ordinary record
    graph.replay()
    assert y.tolist() == [30.0, 30.0, 30.0]  # alpha frozen at capture
    graph.calls[0].update(alpha=5)
    graph.replay()
    assert y.tolist() == [60.0, 60.0, 60.0]
    # --8<-- [end:updatable_use]
    x.fill_(2)
    graph.replay()  # inputs are read live; the update stays
    assert y.tolist() == [120.0, 120.0, 120.0]


def test_a_custom_operator_with_a_host_list_is_one_updatable_call():
    # --8<-- [start:host_list_use]
    query = torch.ones(2)
    graph = HostListGraph()
    with torch.inference_mode(), graph.capture():
        out = paged_decode(query, query, [1, 2])  # one recorded call, kv_lens frozen at capture
    graph.replay()
    assert out.tolist() == [3.0, 3.0]
    graph.calls[0].update(kv_lens=[4, 5])  # what graphmode_update_graph_params does before a replay
    graph.replay()
    assert out.tolist() == [9.0, 9.0]
    # --8<-- [end:host_list_use]


def test_host_memory_stays_host_for_as_long_as_any_view_of_it_lives():
    """A slice of a host buffer kept past the tensor that owns it (a plugin
    caching a slice of a dropped runner's buffer) is host memory, as a CPU
    tensor is on a device; before, the mark died with the owner and the
    emulator refused the slice's read on the host as a device read, a read a
    device accepts. Once the memory is freed, its address is not host memory."""
    from graphmode.emulator import is_host

    owner = mark_host(torch.arange(64))
    view = torch.empty(0, dtype=owner.dtype).set_(owner.untyped_storage(), 0, (8,), (1,))  # no _base holding it
    del owner
    assert is_host(view)
    address = view.untyped_storage().data_ptr()
    del view
    reused = [torch.empty(64, dtype=torch.int64) for _ in range(8)]  # the allocator may hand the address out again
    assert not any(is_host(tensor) for tensor in reused if tensor.untyped_storage().data_ptr() == address)
    assert not any(is_host(tensor) for tensor in reused)
