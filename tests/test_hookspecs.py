"""Every hook is specified, documented, and exercised by a check that fails
without it.

"Exercised" is proved, not searched for: :data:`SABOTAGES` maps every hook
of ``graphmode.hookspecs`` to a check (a conformance-suite test, or a test
written here against any plugin) and to a sabotaged implementation of that
hook, wrong in a way real plugins have been (padding left out, outputs not
cut, a trimmed capture list without its maximum). For each hook the check
must pass on the correct plugin and fail, with its diagnosis, on the same
plugin with that one hook sabotaged. A new hook without an entry fails
:func:`test_every_hook_has_a_sabotage`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from broken_plugins import _frozen_max_len, _live_rows_only, variant  # the suite's own plants
from plugins import walkthrough

import graphmode
import graphmode.default as cuda
import graphmode_ascend.plugin as ascend
from graphmode import CaptureError, ConfigError, GraphModeError, buffers, hookimpl, hookspecs
from graphmode.attention import ReferenceAttentionOps
from graphmode.distributed import init_process_group
from graphmode.graphs import make_device_graph
from graphmode.runner.setup import configure
from graphmode.spec import TOKENS, BufferSpec
from graphmode_conformance import Harness, HookContractTests, LifecycleTests, ParameterUpdateTests, Sizes

ROOT = Path(__file__).resolve().parent.parent
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("graphmode_"))


def harness(vendor: graphmode.Vendor, max_batches: int = 16, **runner_options: Any) -> Harness:
    """The conformance harness on the emulator at small sizes, in a block
    size the vendor accepts."""
    block_size = (vendor.spec.block_sizes or (16,))[0]
    sizes = Sizes(max_batches=max_batches, block_size=block_size, table_width=6)
    return Harness.build(vendor, torch.device("cpu"), sizes, **runner_options)


def refused(call: Callable[[], Any], error: type[BaseException], match: str, what: str) -> None:
    """``call()`` must raise ``error`` matching ``match``; AssertionError otherwise."""
    try:
        call()
    except error as raised:
        assert re.search(match, str(raised)), f"{what}: raised {raised!r}, not matching {match!r}"
    else:
        raise AssertionError(f"{what}: accepted")


# -- checks: each takes the vendor under test and raises AssertionError (or a
#    GraphModeError) when it finds the hook's contract broken ------------------


def vendor_describes_itself(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_vendor_describes_itself(vendor)


def declared_padding_is_neutral(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_declared_padding_is_neutral(harness(vendor), vendor)


def buffers_are_made_as_declared(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_buffers_are_made_as_declared(harness(vendor))


def padding_is_neutral(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_declared_padding_after_shrinks_and_larger_buckets(harness(vendor))


def step_context_points_at_the_buffers(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_step_context_points_at_the_buffers(harness(vendor), vendor)


def compatible_size_is_a_fitting_capture_size(vendor: graphmode.Vendor) -> None:
    HookContractTests().test_compatible_size_holds_the_batch_and_is_a_capture_size(vendor, harness(vendor))


def trimmed_capture_list_ends_at_the_maximum(vendor: graphmode.Vendor) -> None:
    trimmed = harness(vendor, vendor_options={"max_graphs": 3})
    assert len(trimmed.runner.capture_sizes) == 3, f"max_graphs=3 kept {trimmed.runner.capture_sizes}"
    HookContractTests().test_capture_list_is_sorted_unique_and_ends_at_the_largest_graph(trimmed, vendor)


def refuses_a_table_wider_than_the_kernel(vendor: graphmode.Vendor) -> None:
    config = graphmode.RunnerConfig(max_batches=300, max_blocks_per_seq=300, block_size=32, device=torch.device("cpu"))
    refused(lambda: configure(vendor, config), ConfigError, r"max_blocks_per_seq=300: Acme's decode kernel reads block tables of at most 256",
            "a block table of 300 blocks for a kernel of 256")
    configure(vendor, dataclasses.replace(config, max_blocks_per_seq=256))


def a_padded_batch_equals_eager(vendor: graphmode.Vendor) -> None:
    checked = harness(vendor)
    runner = checked.runner
    batch = next(b for b in range(2, 17) if runner.bucket_of(b) != b)
    seqs = checked.start(batch)
    for _ in range(3):  # capture, then replays
        checked.step(seqs)


def every_bucket_warms_up_and_replays(vendor: graphmode.Vendor) -> None:
    LifecycleTests().test_warmup_then_decode(harness(vendor, max_batches=12))


def host_values_reach_every_replay(vendor: graphmode.Vendor) -> None:
    # On every update path the vendor offers (Ascend: graph_update, task_group).
    options = {field.name for field in dataclasses.fields(vendor.spec.options)}
    paths = ("graph_update", "task_group") if "update_path" in options else (None,)
    for path in paths:
        checked = harness(vendor, vendor_options={"update_path": path} if path else None)
        ParameterUpdateTests().test_new_host_values_reach_every_replay(
            vendor.info.capabilities, vendor.implements("graphmode_update_graph_params"), vendor, checked
        )


def capture_errors_get_the_right_advice(vendor: graphmode.Vendor) -> None:
    def runner_raising(message: str) -> Callable[[], Any]:
        def model(input_ids, position_ids, past_key_values, attn_metadata):
            if graphmode.emulator.current_session() is not None:  # inside the capture only
                raise RuntimeError(message)
            return input_ids[..., None].float()

        checked = harness(vendor, max_batches=12)
        runner = graphmode.GraphRunner(model, checked.runner.config, vendor)
        step = checked.engine.decode(checked.start(2))
        return lambda: runner(step.input_ids, step.position_ids, checked.graph_cache, step.attn_metadata)

    refused(runner_raising("ACL error 207008: Stream resources are insufficient."), CaptureError,
            "capturing bucket 2 ran out of NPU streams", "an NPU stream shortage at capture")
    # The error code's digits inside a byte count are not the error.
    oom = "NPU out of memory. Tried to allocate 1.20 GiB (1207008 bytes)"
    refused(runner_raising(oom), RuntimeError, re.escape(oom), "an out-of-memory error at capture")


def a_process_group_forms_on_the_emulator(vendor: graphmode.Vendor) -> None:
    import torch.distributed as dist

    try:
        backend = init_process_group(vendor, torch.device("cpu"), store=dist.HashStore(), rank=0, world_size=1)
    except (RuntimeError, ValueError) as error:
        raise AssertionError(f"vendor {vendor.name}: no process group on cpu with its backend: {error}") from error
    try:
        total = torch.ones(3)
        try:
            dist.all_reduce(total)
        except RuntimeError as error:  # where NCCL is installed, "nccl" forms a group but has no CPU backend
            raise AssertionError(f"vendor {vendor.name}: no process group on cpu with its backend: {error}") from error
        assert total.tolist() == [1.0, 1.0, 1.0], f"all_reduce over one rank gave {total.tolist()} ({backend})"
    finally:
        dist.destroy_process_group()


# -- sabotaged implementations: wrong, the way plugins get it wrong -----------


@hookimpl
def _named_after_the_runtime():
    # The runtime's name, not the entry point's: listings and selection disagree.
    return dataclasses.replace(walkthrough.graphmode_vendor_info(), name="torch_acme")


@hookimpl
def _padding_slot_zero():
    # Slot 0 "looked neutral": padding rows write into the reserved block.
    return walkthrough.ACME_SPEC.with_buffers(BufferSpec("kv_start_indices", torch.int32, shape=(TOKENS,), padding=0))


@hookimpl
def _checks_the_wrong_field(config):
    # The kernel's limit checked against max_batches, not the table's width.
    if config.max_batches > walkthrough.MAX_TABLE_BLOCKS:
        raise ConfigError(f"max_batches={config.max_batches} is above {walkthrough.MAX_TABLE_BLOCKS}")


@hookimpl
def _keeps_the_smallest(config, spec):
    # Trimmed from the wrong end: batches above the last size run eagerly.
    sizes = list(config.capture_batch_sizes or spec.capture_policy(config.max_batches))
    limit = config.vendor_options.max_graphs
    return sizes if limit is None else sizes[:limit]


@hookimpl
def _next_size_up(batch_size, capture_sizes):
    # `>` for `>=`: a batch equal to a capture size pads into the next one.
    bigger = [size for size in capture_sizes if size > batch_size]
    return bigger[0] if bigger else capture_sizes[-1]


@hookimpl
def _without_padding(meta):
    # Zeroed buffers: padding slots 0, lengths 0, instead of the declared padding.
    return {name: torch.zeros_like(tensor) for name, tensor in buffers.allocate(meta).items()}


@hookimpl
def _uncut_outputs(meta, batch_size, num_tokens):
    # The whole bucket's rows, padding included.
    return meta.output_buffers["output"]


@hookimpl
def _one_graph_per_runner(meta):
    # One graph kept per runner (vendor_state is shared by its buckets):
    # the second bucket captures into the first one's graph.
    return meta.vendor_state.setdefault("graph", make_device_graph(meta.device))


@hookimpl
def _only_when_the_batch_changes(graph, meta, batch_size, bucket):
    # An "optimisation": lengths pushed only when the graph's batch changes,
    # but they grow at every step.
    if meta.vendor_state.get("pushed") != (id(graph), batch_size):
        meta.vendor_state["pushed"] = (id(graph), batch_size)
        ascend.graphmode_update_graph_params(graph, meta, batch_size, bucket)


@hookimpl
def _code_anywhere_in_the_message(error, meta, bucket):
    # The error code matched anywhere: "1207008 bytes" is not error 207008.
    if "207008" in str(error):
        return CaptureError(f"capturing bucket {bucket} ran out of NPU streams")
    return None


class NegativeSlotsWrap(ReferenceAttentionOps):
    """Writes slot -1 to the last slot of the cache (Python's negative
    indexing) instead of nowhere."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.kv_start_indices.reshape(-1).long()
        k_cache.view(-1, *k_cache.shape[2:])[slots] = key.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = value.to(v_cache.dtype)


@hookimpl
def _negative_slots_wrap():
    return NegativeSlotsWrap()


@hookimpl
def _nccl_everywhere(device):
    # Copied from a CUDA plugin: no NCCL for the emulator's CPU tensors.
    return "nccl"


@dataclass(frozen=True)
class Sabotage:
    """base: the correct plugin; broken: the sabotaged implementation of the
    hook; check: the test of that hook; fails_with: what its failure says."""

    base: Any
    broken: Callable[..., Any]
    check: Callable[[graphmode.Vendor], None]
    fails_with: str


SABOTAGES = {
    "graphmode_vendor_info": Sabotage(
        walkthrough, _named_after_the_runtime, vendor_describes_itself,
        "graphmode_vendor_info names 'torch_acme', registered as 'acme'"),
    "graphmode_graph_spec": Sabotage(
        walkthrough, _padding_slot_zero, declared_padding_is_neutral, "kv_start_indices padding 0 .must be -1: no KV write"),
    "graphmode_check_config": Sabotage(
        walkthrough, _checks_the_wrong_field, refuses_a_table_wider_than_the_kernel,
        "a block table of 300 blocks for a kernel of 256: (accepted|raised .*max_batches)"),
    "graphmode_capture_sizes": Sabotage(
        walkthrough, _keeps_the_smallest, trimmed_capture_list_ends_at_the_maximum,
        r"returned \[1, 3, 6\] at max_batches=16: it ends at 6, and the vendor declares no largest graph"),
    "graphmode_compatible_size": Sabotage(
        walkthrough, _next_size_up, compatible_size_is_a_fitting_capture_size,
        r"graphmode_compatible_size\(1\) returned 3 \(the next capture size: a search that skips a size equal to the "
        r"batch, bisect_right where bisect_left is meant\), but 1 is a capture size .*: each capture size must be its own "
        r"bucket"),
    "graphmode_make_buffers": Sabotage(walkthrough, _without_padding, buffers_are_made_as_declared, "graphmode_make_buffers"),
    "graphmode_fill_buffers": Sabotage(cuda, _live_rows_only, padding_is_neutral, "padding left stale after the batch shrank"),
    "graphmode_update_context": Sabotage(
        walkthrough, _frozen_max_len, step_context_points_at_the_buffers, "the graph context has max_kv_seq_len=[1-9]"),
    "graphmode_get_outputs": Sabotage(walkthrough, _uncut_outputs, a_padded_batch_equals_eager, "outputs not cut to the live tokens"),
    "graphmode_make_graph": Sabotage(
        walkthrough, _one_graph_per_runner, every_bucket_warms_up_and_replays,
        "returned the graph object it returned for bucket .* Hook: graphmode_make_graph must return a new graph"),
    "graphmode_update_graph_params": Sabotage(
        ascend, _only_when_the_batch_changes, host_values_reach_every_replay,
        "no parameter update recorded since the last replay; on the device this replay would hang"),
    "graphmode_capture_error": Sabotage(
        ascend, _code_anywhere_in_the_message, capture_errors_get_the_right_advice,
        "an out-of-memory error at capture: raised CaptureError.*ran out of NPU streams"),
    "graphmode_attention_ops": Sabotage(
        cuda, _negative_slots_wrap, a_padded_batch_equals_eager, "cache slots of layer 0 that no live token of this step writes"),
    "graphmode_dist_backend": Sabotage(
        walkthrough, _nccl_everywhere, a_process_group_forms_on_the_emulator, "no process group on cpu with its backend"),
}


def _vendor(hook: str, sabotaged: bool) -> graphmode.Vendor:
    entry = SABOTAGES[hook]
    name = entry.base.graphmode_vendor_info().name
    changes = {hook: entry.broken} if sabotaged else {}
    return graphmode.load_vendor(name, plugin=variant(entry.base, name, **changes))


def test_there_are_hooks():
    assert len(HOOKS) == 14


def test_every_hook_has_a_sabotage():
    missing = sorted(set(HOOKS) - set(SABOTAGES))
    assert not missing, (
        f"hooks {missing} have no entry in SABOTAGES: give each a check that fails when the hook is "
        "wrong, and a sabotaged implementation that proves it"
    )
    assert sorted(SABOTAGES) == HOOKS, f"SABOTAGES names hooks that do not exist: {sorted(set(SABOTAGES) - set(HOOKS))}"


@pytest.mark.parametrize("hook", HOOKS)
def test_the_hook_s_check_passes_on_the_correct_plugin(hook):
    SABOTAGES[hook].check(_vendor(hook, sabotaged=False))


@pytest.mark.filterwarnings("ignore:Attempted to get default timeout for nccl backend")
@pytest.mark.parametrize("hook", HOOKS)
def test_the_hook_s_check_fails_when_the_hook_is_sabotaged(hook):
    entry = SABOTAGES[hook]
    vendor = _vendor(hook, sabotaged=True)
    assert [impl.function for impl in getattr(vendor.hook, hook).get_hookimpls() if impl.plugin is vendor.plugin] == [
        entry.broken
    ]
    with pytest.raises((AssertionError, GraphModeError), match=entry.fails_with):
        entry.check(vendor)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_states_its_call_semantics(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert "Stops at the first non-None result" in doc or "Every implementation is called" in doc, doc


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    parameters = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    assert f"`{name}({parameters})`" in (ROOT / "docs" / "hooks.md").read_text()


@pytest.mark.parametrize("name", HOOKS)
def test_the_default_plugin_implements_every_hook_but_the_vendor_only_ones(name):
    vendor_only = {"graphmode_check_config", "graphmode_update_graph_params", "graphmode_capture_error"}
    assert hasattr(cuda, name) != (name in vendor_only)
