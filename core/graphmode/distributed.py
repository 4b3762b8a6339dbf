"""Graph mode across tensor-parallel ranks, without hangs.

Collectives inside a captured graph only work if every rank replays the same
graph: same bucket list, same bucket each step, captures in the same order.
A rank that disagrees would hang inside NCCL; :class:`RankSync` finds the
disagreement first, on a separate gloo group that involves no device, and
raises an error naming every rank's value.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from graphmode.errors import ConfigError, InputError

if TYPE_CHECKING:
    from graphmode.plugins import Vendor

__all__ = ["RankSync", "init_process_group", "torchrun_rank"]

#: What a step agreement counts: sequences of a full graph, tokens of a piecewise one.
_UNITS = ("batch", "tokens")


def init_process_group(vendor: Vendor, device: torch.device, **kwargs: Any) -> str:
    """Initialise the default process group with the vendor's backend for
    ``device`` (nccl on CUDA, hccl on Ascend, cncl on Cambricon, gloo on the
    CPU emulator) and return the backend's name."""
    backend = vendor.hook.graphmode_dist_backend(device=torch.device(device))
    dist.init_process_group(backend, **kwargs)
    return backend


def torchrun_rank(device_type: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device) in a process started by
    torchrun, the device made current."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(device_type if device_type == "cpu" else f"{device_type}:{local}")
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "set_device"):
        module.set_device(device)
    return rank, world, device


class RankSync:
    """Agreement checks and a capture barrier for one process group.

    check_replays: also agree on the batch before every graph step, not only
    before captures. It costs one small host all-gather per step, and turns a
    rank that would replay a different graph (and hang its peers inside the
    graph's collectives) into an error.
    """

    def __init__(self, group: dist.ProcessGroup, check_replays: bool = False) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.check_replays = check_replays
        ranks = dist.get_process_group_ranks(group)
        self.control = dist.new_group(ranks=ranks, backend="gloo")
        # How errors name a graph variant by its number (the runner sets its labels).
        self.name_variant: Callable[[int], str] = lambda index: f"graph variant #{index}"

    def _gather(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.control)
        return values

    def agree_on_setup(self, execute_mode: str, capture_sizes: tuple[int, ...], token_sizes: tuple[int, ...] = (),
                       variants: str = "") -> None:
        """Every rank captures the same graphs: the same mode, batch buckets,
        (piecewise modes) token buckets and graph variants (as text)."""
        values = self._gather((execute_mode, list(capture_sizes), list(token_sizes), variants))
        if any(v != values[0] for v in values):
            listing = "; ".join(
                f"rank {r}: {mode} mode, buckets {sizes}" + (f", token buckets {tokens}" if tokens else "")
                + (f", graph_variants {declared}" if declared else "")
                for r, (mode, sizes, tokens, declared) in enumerate(values)
            )
            raise ConfigError(
                f"tensor-parallel ranks disagree on graph mode: {listing}. Every rank must capture the "
                "same buckets in the same order: give every rank the same execute mode, "
                "capture_batch_sizes, capture_token_sizes, graph_variants and vendor options"
            )

    def agree_on_step(self, batch: int, bucket: int | None, what: str, unit: str = "batch",
                      variant: int = 0) -> None:
        """Every rank runs a step of the same size in the same graph (a
        ``batch`` of sequences, or with ``unit="tokens"`` a token count) of
        the same graph variant (``GraphVariants.index``; 0 the plain one), or
        raise naming each rank's."""
        # Normal tensors even inside the engine's torch.inference_mode(): gloo
        # in torch 2.5 writes the gathered values from outside inference mode,
        # which refuses an in-place update of an inference tensor.
        # The unit tells the families apart: a full graph of batch 4 and a
        # piecewise graph of 4 tokens run other collectives.
        with torch.inference_mode(False):
            mine = torch.tensor([_UNITS.index(unit), batch, bucket or 0, variant], dtype=torch.int64)
            everyone = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(everyone, mine, group=self.control)
        if any(not torch.equal(other, everyone[0]) for other in everyone):
            values = [tuple(t.tolist()) for t in everyone]
            listing = "; ".join(
                f"rank {r}: {_UNITS[u]} {b} ({f'bucket {k}' if k else 'no graph'}"
                f"{f', {self.name_variant(v)}' if any(value[3] for value in values) else ''})"
                for r, (u, b, k, v) in enumerate(values)
            )
            raise InputError(
                f"tensor-parallel ranks disagree on the step to {what}: {listing}. Every rank must run "
                "the same step (the same sequences and tokens, the same graph variant values) at the same "
                "time; check how the engine sends the schedule to its ranks"
            )

    def barrier(self) -> None:
        """Every rank ready, its device idle, before any of them captures."""
        dist.barrier(group=self.control)
