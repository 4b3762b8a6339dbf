"""Host staging: a runner's device input buffers fed from pinned host mirrors.

With host staging, the device input buffers (what ``graphmode_make_buffers``
returned on the device) are views of ONE device byte arena, and the arena has
pinned host mirrors of identical layout (:data:`SLOTS` of them). A replay step
is: the host writes the step's rows into a mirror (CPU copies, no kernel
launch), launches one copy of that mirror into the arena
(``arena[:n].copy_(mirror[:n], non_blocking=True)``), then
``graph.replay()``: one packed copy and one launch, the hand-written floor.

Layout: buffers in the order ``graphmode_make_buffers`` returned them, each at
a 256-byte aligned offset, ``block_offsets`` (the largest) last, so that the
step of bucket ``b`` copies one prefix: every other buffer whole and the
first ``b`` rows of the block table (the rows its context reads).

Ordering, without host waits for the device: the copy into the arena is
launched on the stream after the previous replay, so it never overwrites
inputs a running graph reads. The host must not write a mirror before the
copy launched from it has run: steps take the :data:`SLOTS` mirrors in
turn, in groups of ``graphmode.ring.GROUP``; an event is recorded after the copy from
a group's last mirror (a record costs the host about a launch), and a step
that starts a group waits on the group's event from the previous lap
(graphmode.ring). With four mirrors in groups of two, a step waits at most
for the copy launched three steps before it: a host issuing steps while
earlier ones run (an engine scheduling ahead) never waits, unless it is
three steps ahead of the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphmode.context import REQUIRED_TENSORS, StepInputs
from graphmode.emulator.host import is_host, mark_host
from graphmode.errors import InputError
from graphmode.meta import GraphMeta
from graphmode.ring import SLOTS, Ring, native_ring

if TYPE_CHECKING:
    from graphmode.plugins import Vendor

__all__ = ["ALIGNMENT", "SLOTS", "HostStaging", "staging_refusal", "to_device", "to_host"]

ALIGNMENT = 256
_TABLE = "block_offsets"
_ROUTE_CACHE_LIMIT = 4096


class HostStaging:
    """The arena, its pinned mirrors and the host copy of the padding values
    of one runner's device input buffers. Building it re-homes the device
    tensors of ``meta.input_buffers`` into the arena (same shapes, dtypes and
    values), and sets ``meta.staging``, through which
    :func:`graphmode.buffers.stage` routes the runner's copies; host buffers
    stay where they are."""

    def __init__(self, meta: GraphMeta) -> None:
        self.device = meta.device
        self.max_batches = meta.max_batchs
        emulated = meta.device.type == "cpu"
        # On the emulator every tensor is a CPU tensor: host memory is marked.
        self.on_host: Callable[[torch.Tensor], bool] = is_host if emulated else _is_cpu
        names = [n for n, t in meta.input_buffers.items() if not self.on_host(t)]
        if _TABLE in names:
            names.remove(_TABLE)
            names.append(_TABLE)
        self.offsets: dict[str, int] = {}
        size = 0
        for name in names:
            size = _aligned(size)
            self.offsets[name] = size
            size += _nbytes(meta.input_buffers[name])
        self.nbytes = _aligned(size)
        self.arena = torch.zeros(self.nbytes, dtype=torch.uint8, device=meta.device)
        if emulated:
            self.mirrors = [mark_host(torch.zeros(self.nbytes, dtype=torch.uint8), pinned=True) for _ in range(SLOTS)]
        else:
            self.mirrors = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(SLOTS)]
        for name in names:
            old = meta.input_buffers[name]
            meta.input_buffers[name] = view = self._view(self.arena, name, old)
            view.copy_(old)
        for mirror in self.mirrors:
            mirror.copy_(self.arena)
        # Host copies of the constant sources (padding, live values), found by storage.
        constants = [
            *meta.padding_buffers.values(), *meta.live_buffers.values(),
            *(t for paddings in meta.q_len_padding.values() for t in paddings.values()),
        ]
        self._constants = {
            t.untyped_storage().data_ptr(): (t, _host_copy(t, emulated)) for t in constants if not self.on_host(t)
        }
        self._buffers = {name: meta.input_buffers[name] for name in names}
        self._arena_range = (self.arena.data_ptr(), self.arena.data_ptr() + self.nbytes)
        # Per mirror: destination -> its view in that mirror.
        self._slot_routes: list[dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = [{} for _ in range(SLOTS)]
        self._host_sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: Whose turn each mirror is, and the ordering of their copies (the native ring on CUDA where it is built).
        self.ring: Any = native_ring(meta.device) if not emulated else None
        if self.ring is None:
            self.ring = Ring(meta.device, emulated)
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, bucket) -> (arena, mirror) views
        meta.fill_plans.clear()  # views of the old buffers
        meta.staging = self

    def _view(self, memory: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        start = self.offsets[name]
        return memory[start:start + _nbytes(like)].view(like.dtype).view(like.shape)

    # -- the copy before every replay -----------------------------------------

    def region(self, bucket: int) -> int:
        """Bytes of the arena the step of ``bucket`` copies: every buffer but
        the block table whole, and the block table's first ``bucket`` rows."""
        table = self._buffers.get(_TABLE)
        if table is None or table.shape[0] != self.max_batches:
            return self.nbytes
        return self.offsets[_TABLE] + bucket * table.stride(0) * table.element_size()

    @property
    def slot(self) -> int:
        """The mirror the step under way writes (``mirrors[slot]``)."""
        return self.ring.slot

    @property
    def mirror(self) -> torch.Tensor:
        return self.mirrors[self.ring.slot]

    @property
    def _routes(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        return self._slot_routes[self.ring.slot]

    def begin(self) -> None:
        """Before a step writes a mirror: take the next mirror, waiting (on
        the host) until no copy launched from it can still run: at a group's
        first mirror, for the group's event from the previous lap
        (graphmode.ring)."""
        self.ring.begin()

    def launch(self, bucket: int) -> None:
        """Launch the copy of this step's mirror (its region for ``bucket``)
        into the arena, after the work launched before it (the previous
        replay: it never overwrites inputs a running graph reads); after the
        copy from a group's last mirror, the group's event."""
        self.ring.copy(*self.copy_views(self.ring.slot, bucket))

    def copy_views(self, slot: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(arena, mirror ``slot``) views of the region the step of ``bucket`` copies."""
        views = self._copies.get((slot, bucket))
        if views is None:  # made once per mirror and bucket
            end = self.region(bucket)
            views = self._copies[(slot, bucket)] = (self.arena[:end], self.mirrors[slot][:end])
        return views

    def wait(self) -> None:
        """Block the host until every launched copy of a mirror has run."""
        self.ring.wait()

    # -- routing the step's copies --------------------------------------------

    def holds(self, tensor: torch.Tensor) -> bool:
        low, high = self._arena_range
        return low <= tensor.data_ptr() < high

    def mirror_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of the mirror (or another host byte tensor) with the
        tensor's place in the arena."""
        return _like(self.mirror, tensor, tensor.storage_offset())

    def in_mirror(self, tensor: torch.Tensor, slot: int) -> torch.Tensor:
        """``tensor``, a view of one of the mirrors, as the same view of
        mirror ``slot``; any other tensor as it is."""
        home = tensor.untyped_storage().data_ptr()
        if not any(m.untyped_storage().data_ptr() == home for m in self.mirrors):
            return tensor
        return _like(self.mirrors[slot], tensor, tensor.storage_offset())

    def host_source(self, source: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
        """``source`` as a host tensor: itself when on the host, the same view
        of the host copy of a constant (padding, live values); a step input on
        the device is refused."""
        if self.on_host(source):
            return source
        cached = self._host_sources.get(id(source))
        if cached is not None and cached[0] is source:
            return cached[1]
        constant = self._constants.get(source.untyped_storage().data_ptr())
        if constant is None:
            raise InputError(
                f"the step's rows for the {self.buffer_name(destination)!r} buffer are a device "
                f"tensor ({source.device}), but this runner stages its inputs on the host (host "
                "staging): reading them would need a device-to-host copy every step. Pass the "
                f"step's inputs as host (CPU) tensors{emulator_host_hint(self.device)}, or build the runner "
                "with host_staging=False"
            )
        host = _like(constant[1], source, source.storage_offset())
        if len(self._host_sources) > _ROUTE_CACHE_LIMIT:
            self._host_sources.clear()
        self._host_sources[id(source)] = (source, host)
        return host

    def buffer_name(self, tensor: torch.Tensor) -> str:
        offset = tensor.data_ptr() - self._arena_range[0]
        return max((start, name) for name, start in self.offsets.items() if start <= offset)[1]

    def route(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, host_sources: bool = True
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (destination, source) pairs with every destination in the arena
        replaced by its mirror view, and its source by a host tensor (left
        as is with ``host_sources=False``)."""
        routed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for destination, source in pairs:
            entry = self._routes.get(id(destination))
            if entry is None or entry[0] is not destination:
                entry = (destination, self.mirror_of(destination) if self.holds(destination) else None)
                if len(self._routes) > _ROUTE_CACHE_LIMIT:
                    self._routes.clear()
                self._routes[id(destination)] = entry
            mirror = entry[1]
            if mirror is None:
                routed.append((destination, source))
            else:
                routed.append((mirror, self.host_source(source, destination) if host_sources else source))
        return routed


def _like(memory: torch.Tensor, tensor: torch.Tensor, offset: Any) -> torch.Tensor:
    """A view of byte tensor ``memory`` with ``tensor``'s dtype, shape and
    strides at element ``offset``."""
    return memory.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), offset)


def _host_copy(tensor: torch.Tensor, emulated: bool) -> torch.Tensor:
    """A host copy of ``tensor`` (marked as host memory on the emulator)."""
    copy = tensor.to("cpu", copy=True)
    return mark_host(copy) if emulated else copy


def _is_cpu(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def staging_refusal(vendor: Vendor, device: torch.device) -> str | None:
    """Why host staging cannot be used with ``vendor`` on ``device``, or None.

    The mirror's copy overwrites the arena before every replay, so every
    write of the vendor's fill hook must go through
    :func:`graphmode.buffers.stage`: true of the built-in fill, and of
    plugins that declare the ``host_staging`` capability. The pinned copy and
    its event ordering are checked on CUDA and the emulator only."""
    if device.type not in ("cuda", "cpu"):
        return f"host staging runs on CUDA and the cpu emulator, not {device.type}"
    if not vendor.built_in_only("graphmode_fill_buffers") and "host_staging" not in vendor.info.capabilities:
        return (
            f"vendor {vendor.name!r} fills its buffers with its own graphmode_fill_buffers and does not "
            "declare the 'host_staging' capability (every buffer write through graphmode.buffers.stage)"
        )
    return None


def emulator_host_hint(device: torch.device) -> str:
    """On the emulator, what a host tensor is: every tensor there is a CPU
    tensor, so "pass host (CPU) tensors" alone does not say how."""
    if device.type != "cpu":
        return ""
    return (" (on the CPU emulator every tensor is a CPU tensor: host tensors are those marked with "
            "graphmode.emulator.mark_host(t), and graphmode.staging.to_host(step, device) marks a step's)")


def to_host(inputs: StepInputs, device: torch.device, extras: Collection[str] = ()) -> StepInputs:
    """``inputs`` with its per-step tensors as host tensors, as an engine that
    builds its steps on the host passes them (for a runner on ``device``; on
    the emulator, host copies marked as host memory). ``extras`` names the
    keywords of ``inputs.extras`` to move too: the engine's declared step
    inputs, which are data; any other extra is frozen by identity and stays."""
    if device.type == "cpu":
        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if is_host(tensor) else mark_host(tensor.clone())
    else:
        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.cpu()
    return _moved(inputs, move, extras)


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """``inputs`` with its per-step host tensors copied to ``device`` (a copy
    on the emulator, whose "device" memory is unmarked CPU memory).

    The engine's host tensors may be written as soon as the call returns.
    A ``non_blocking`` copy from pageable memory has read it when it returns
    (the driver stages it); one from pinned memory reads it when the device
    reaches the copy, later: an engine reusing a pinned buffer (vLLM's
    ``CpuGpuBuffer``) would have its next step's values read. A pinned
    tensor is therefore first copied on the host into pinned memory of the
    runner's, which the caching host allocator keeps until the copy has run."""
    if device.type == "cpu":
        move: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.clone
    else:
        def move(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_pinned():
                tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
            return tensor.to(device, non_blocking=True)
    return _moved(inputs, move)


def _moved(inputs: StepInputs, move: Callable[[torch.Tensor], torch.Tensor], extras: Collection[str] = ()) -> StepInputs:
    attn = inputs.attn_metadata
    return dataclasses.replace(
        inputs,
        input_ids=move(inputs.input_ids),
        position_ids=move(inputs.position_ids),
        attn_metadata=attn.replace(**{name: move(getattr(attn, name)) for name in REQUIRED_TENSORS}),
        # A new dict only when some extra moves: to_device runs at every host-input step.
        extras={name: move(value) if name in extras and isinstance(value, torch.Tensor) else value
                for name, value in inputs.extras.items()} if extras else inputs.extras,
    )
