"""A hook that reads a device value on the host during a replay step (fill,
parameter update, outputs) is refused on the emulator, naming the hook; host
memory stays readable (Ascend reads its host kv lengths every step)."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ReplayError
from graphmode.buffers import host_zeros
from graphmode.checks.host_reads import CudaSyncGuard, replay_guard
from graphmode.emulator import ReplayHostReadGuard, is_host, mark_host


class ReadsInFill:
    """Sizes something from the device's kv lengths while filling."""

    @graphmode.hookimpl(wrapper=True)
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        result = yield
        self.longest = int(inputs.attn_metadata.kv_seqlens.max())
        return result


class ReadsInUpdate:
    """Pushes kv lengths read back from the device buffer."""

    @graphmode.hookimpl
    def graphmode_update_graph_params(self, graph, meta, batch_size, bucket):
        self.lengths = meta.input_buffers["kv_seqlens"][:bucket].tolist()


class CopiesIntoHostMemory:
    """Copies the device's kv lengths into a host buffer of its own (a
    device-to-host read however the value lands)."""

    @graphmode.hookimpl(wrapper=True)
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        result = yield
        host = meta.vendor_state.setdefault("host_lengths", host_zeros(meta, (meta.max_batchs,), torch.int32))
        host[:batch_size] = inputs.attn_metadata.kv_seqlens
        return result


class CopiesInUpdate:
    """Copies a device buffer into host memory with copy_ before pushing."""

    @graphmode.hookimpl
    def graphmode_update_graph_params(self, graph, meta, batch_size, bucket):
        host = meta.vendor_state.setdefault("host_starts", host_zeros(meta, (meta.max_batchs,), torch.int32))
        torch._foreach_copy_([host[:bucket]], [meta.input_buffers["q_start_loc"][:bucket]])


class ReadsInOutputs:
    """Checks the output on the host before returning it."""

    @graphmode.hookimpl(wrapper=True)
    def graphmode_get_outputs(self, meta, batch_size, num_tokens):
        output = yield
        assert output[0, 0].sum().item() == output[0, 0].sum().item()
        return output


@pytest.mark.parametrize(
    "plugin, hook, what",
    [
        (ReadsInFill(), "graphmode_fill_buffers", "Tensor.__int__()"),
        (ReadsInUpdate(), "graphmode_update_graph_params", "Tensor.tolist()"),
        (ReadsInOutputs(), "graphmode_get_outputs", "Tensor.item()"),
        (CopiesIntoHostMemory(), "graphmode_fill_buffers", "Tensor.__setitem__()"),
        (CopiesInUpdate(), "graphmode_update_graph_params", "torch._foreach_copy_()"),
    ],
)
def test_a_host_read_of_device_memory_on_the_replay_path_names_the_hook(plugin, hook, what):
    setup = tiny_setup(type(plugin).__name__, plugin=plugin)
    seqs = setup.prefill(3, [2, 9, 17])
    setup.decode(seqs)  # the capture step reads freely: it is not a replay
    with pytest.raises(ReplayError) as error:
        setup.decode(seqs)
    message = str(error.value)
    assert message.startswith(f"{hook} read a device value on the host during a replay step ({what} of device memory")
    assert f"called at {__file__}:" in message
    assert "Read a host copy instead (a buffer declared BufferSpec(..., host=True), read as meta.input_buffers" in message


def test_host_memory_may_be_read_on_the_replay_path(monkeypatch):
    """Ascend's update hook reads its host kv-length buffer every step."""
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "task_group")
    setup = tiny_setup("ascend")
    seqs = setup.prefill(3, [2, 9, 17])
    for _ in range(3):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.replays == 2


def test_what_is_computed_from_host_memory_alone_is_host_memory():
    # On a device an operator on CPU tensors runs on the host: a vendor
    # narrowing the engine's int64 host lengths into its int32 host buffer
    # copies host to host, and may read the result.
    lengths = mark_host(torch.tensor([5, 9, 130000]))
    staged = mark_host(torch.zeros(3, dtype=torch.int32))
    with ReplayHostReadGuard():
        narrowed = lengths.to(torch.int32)
        staged.copy_(narrowed)
        assert (lengths + 1).max().item() == 130001
        assert torch.cat([lengths, lengths.clamp(max=10)]).tolist() == [5, 9, 130000, 5, 9, 10]
        assert staged.tolist() == [5, 9, 130000]


@pytest.mark.parametrize("move", [
    lambda host, device: host.to(device, torch.int32),
    lambda host, device: host.to(device=device, dtype=torch.int32),
    lambda host, device: torch.zeros_like(host, device=device),
    lambda host, device: host + torch.ones(2, dtype=torch.int64),  # with device memory
])
def test_what_a_call_moves_to_the_device_or_mixes_with_it_is_device_memory(move):
    host = mark_host(torch.tensor([5, 9]))
    moved = move(host, torch.device("cpu"))  # on the emulator the device's tensors are CPU tensors
    with pytest.raises(ReplayError, match="Tensor.tolist"), ReplayHostReadGuard():
        move(host, torch.device("cpu")).tolist()
    assert not is_host(moved)


def test_the_guard_is_left_after_a_refused_read():
    setup = tiny_setup("ReadsInFill", plugin=ReadsInFill())
    seqs = setup.prefill(2, [3, 4])
    setup.decode(seqs)
    with pytest.raises(ReplayError):
        setup.decode(seqs)
    assert torch._C._len_torch_function_stack() == 0
    assert torch.ones(2).sum().item() == 2.0


def test_cuda_checks_only_when_asked(monkeypatch):
    monkeypatch.delenv("GRAPHMODE_CHECK_HOST_READS", raising=False)
    assert not isinstance(replay_guard(torch.device("cuda", 0)), CudaSyncGuard)
    monkeypatch.setenv("GRAPHMODE_CHECK_HOST_READS", "1")
    assert isinstance(replay_guard(torch.device("cuda", 0)), CudaSyncGuard)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_synchronising_read_names_the_hook(monkeypatch):
    monkeypatch.setenv("GRAPHMODE_CHECK_HOST_READS", "1")
    setup = tiny_setup("ReadsInOutputs", plugin=ReadsInOutputs(), device="cuda")
    seqs = setup.prefill(3, [2, 9, 17])
    setup.decode(seqs)
    with pytest.raises(ReplayError, match=r"^graphmode_get_outputs read a device value on the host during a replay step \(a synchronizing CUDA operation"):
        setup.decode(seqs)
    assert torch.cuda.get_sync_debug_mode() == 0
