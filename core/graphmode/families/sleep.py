"""Sleep and wake: a runner's graph memory given back, its graphs made again.

An engine that sleeps (vLLM's and lmdeploy's sleep modes: weights and KV
cache offloaded or discarded so that another process may use the device)
needs every byte its graphs hold back too. :func:`release` drops one
runner's graphs of every family, their output buffers, the input buffers
(``GraphMeta``, its padding snapshot), the piecewise break-point and
step-input buffers, host staging's arena and mirror, the native step's memo
and, once no runner sharing it holds a graph, the memory pool; what it
returns (:class:`Asleep`) names the graphs only (bucket, query length,
variant, the frozen extras they captured), none of their memory, so that
``empty_cache()`` can give everything to the driver.

:func:`recapture` makes those graphs again at wake, as ``warmup()`` does:
from inert steps on the cache the engine passes, largest first, the families
in warm-up order, into one new pool. Capturing at wake rather than lazily at
each bucket's next step keeps capture time out of the serving loop, keeps the
pool laid out largest first (a lazy order can take more memory), and takes
the KV cache as the engine has it after wake (reallocated, at other
addresses, or the same tensors): the graphs read what the model and cache
hold at wake, so weights replaced while asleep are the ones captured.

Why not keep the graphs and free only their pool: a captured device graph
holds the addresses of its pool's blocks; freeing them under it leaves
graphs that would replay into memory the driver gave to someone else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphmode.context import KVCache
from graphmode.errors import ReplayError

if TYPE_CHECKING:
    from graphmode.families.family import Report, RunnerContext

__all__ = ["Asleep", "SleptGraph", "asleep_error", "recapture", "release"]


@dataclass(frozen=True)
class SleptGraph:
    """One graph a family released at sleep, as wake captures it again.

    variant: its graph variant's key (``graphmode.variants``). key: its key
    in its family, ``(bucket, q_len)`` for a full graph, the token bucket for
    a piecewise one. extras: the extra inputs without a buffer it captured
    by reference, captured again as the same objects (later steps pass them)."""

    variant: tuple[Any, ...]
    key: Any
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Asleep:
    """What one runner released at sleep: its graphs by family name, in
    capture order. Holds no device memory."""

    graphs: dict[str, list[SleptGraph]]

    @property
    def count(self) -> int:
        """How many graphs wake captures again."""
        return sum(len(graphs) for graphs in self.graphs.values())


def release(shared: RunnerContext) -> Asleep:
    """Drop every graph and graph-owned buffer of the runner whose
    :class:`RunnerContext` this is, and its hold on the pool; what to capture again."""
    asleep = Asleep({family.name: family.release() for family in shared.families})
    shared.meta = None  # the input buffers and their padding snapshot: made again at the first capture
    shared.release_pool()  # forgotten once no runner sharing it holds a graph
    shared.cache_fit.forget()  # the cache may come back reallocated
    return asleep


def recapture(shared: RunnerContext, asleep: Asleep, past_key_values: KVCache, report: Report) -> None:
    """Capture ``asleep``'s graphs again on ``past_key_values``, as
    ``warmup()`` orders them: variant by variant (in the order they were
    first captured), the families in reverse order, each largest first."""
    variants = dict.fromkeys(graph.variant for graphs in asleep.graphs.values() for graph in graphs)
    for variant in variants:
        shared.use_variant(variant)
        for family in reversed(shared.families):
            todo = [graph for graph in asleep.graphs.get(family.name, ()) if graph.variant == variant]
            if todo:
                family.recapture(past_key_values, todo, report)


def asleep_error(call: str) -> ReplayError:
    """The error for ``call`` ("a step", "runner.warmup()") on a runner that
    is asleep."""
    return ReplayError(
        f"{call} on a runner that is asleep: runner.sleep() released its graphs, their buffers and the memory pool "
        "(and those of every runner sharing its pool), and the engine may have offloaded the weights and the KV "
        "cache. Call runner.wake(past_key_values) first, once the weights and the cache are back: it captures the "
        "graphs again (or runner.reset(), to forget them and capture at each bucket's next step)"
    )
