"""Per-runner statistics: what graph mode did, and what it cost in padding."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from graphmode.variants import PLAIN

__all__ = ["EAGER_REASONS", "FamilyStats", "RunnerStats"]

EAGER_REASONS = {
    "eager_mode": "execute_mode is eager",
    "prefill": "not a decode step (prefill, or prefill mixed with decode)",
    "multi_token_decode": "a decode step of more new tokens per sequence than the runner's max_q_len",
    "mixed_q_len": "a decode step whose sequences carry different numbers of new tokens (or whose "
                   "max_q_seq_len does not prove them equal: tokens != batch x max_q_seq_len)",
    "no_bucket": "the batch is larger than the largest capture size",
    "no_token_bucket": "the step has more tokens than the largest piecewise token bucket (capture_token_sizes)",
    "per_sequence_input": "a piecewise step of other than one token per sequence with a step input declared "
                          "per sequence, which its segments cannot map to tokens (declare it per token)",
}


@dataclass
class FamilyStats:
    """What one graph family did, the same counters for every family.

    captures: graphs captured, warm-up included. warmup_captures: those
    captured by ``warmup()`` (and wakes) from inert steps, which serve no
    tokens. replays: steps served by replaying a graph (the native step's
    included). real_tokens / padded_tokens: the live and padding tokens of
    its graph steps (a padding row of a graph of q_len tokens per sequence
    counts q_len). replays_by_q_len: replays by the graph's new tokens per
    sequence, for a family whose graphs have one (full decode graphs: 1 for
    one-token decode, 1 + k for speculative verify of k draft tokens).
    replays_by_variant: replays by graph variant label (``graph_variants``)."""

    captures: int = 0
    warmup_captures: int = 0
    replays: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    replays_by_q_len: Counter = field(default_factory=Counter)
    replays_by_variant: Counter = field(default_factory=Counter)


def _counter_of(family: str, counter: str) -> Any:
    """A read-only property: that counter of that family's :class:`FamilyStats`
    (0, or an empty Counter, before the family's first count)."""
    return property(lambda stats: getattr(stats._of(family), counter),
                    doc=f"``families[{family!r}].{counter}``")


@dataclass
class RunnerStats:
    """What graph mode did. ``families``: each graph family's own counters
    (:class:`FamilyStats`), by family name ("full", "piecewise"), made at
    its first count; the runner-wide figures below are read from them.

    captures, warmup_captures, replays, replays_by_q_len: the full decode
        graphs' (``families["full"]``). piecewise_captures / piecewise_replays:
        the piecewise graphs' (one per token bucket, however many segments),
        warm-up included.
    real_tokens / padded_tokens: live and padding tokens of graph steps, every family's.
    replays_by_variant: replays of every family by graph variant
        (``graph_variants``): "plain" for steps with every variant keyword at
        its default (all of them when none is declared), "lora=True" for others.
    eager_steps: steps run eagerly, by reason (see ``EAGER_REASONS``).
    derived_host_copies: steps whose host field (``kv_seqlens_cpu``) a
        vendor reads but the engine omitted, so that graphmode copied its
        device field to the host (one device-to-host copy each: pass the
        field to save it; ``graphmode.families.host_fields``).
    verify_length_reads: device-built verify steps (several new tokens per
        sequence in a full graph) whose query lengths graphmode read to the
        host to prove them uniform, which their host facts could not (one
        device-to-host copy each: build verify steps on the host to save it;
        ``graphmode.checks.host_lengths.check_device_verify_step``).
    compile_seconds: with compile=True, host seconds spent in the compiled
        forward's warm-up calls before captures: Dynamo tracing, Inductor
        compilation and autotuning (on the first call of each shape it
        compiles for), plus the launch of each warm-up step.
    sleeps / wakes: ``runner.sleep()`` calls that released graphs (a
        runner asleep through a runner sharing its pool counts its own), and
        ``runner.wake()`` calls that captured them again.
        recaptures: graphs (of every family) captured again by wakes,
        counted as warm-up's inert captures are too (in their family's
        ``captures`` and ``warmup_captures``)."""

    families: dict[str, FamilyStats] = field(default_factory=dict)
    eager_steps: Counter = field(default_factory=Counter)
    compile_seconds: float = 0.0
    derived_host_copies: int = 0
    verify_length_reads: int = 0
    sleeps: int = 0
    wakes: int = 0
    recaptures: int = 0

    def family(self, name: str) -> FamilyStats:
        """The counters of the family of that name (made at first use)."""
        counts = self.families.get(name)
        if counts is None:
            counts = self.families[name] = FamilyStats()
        return counts

    def _of(self, name: str) -> FamilyStats:
        """The counters of that family to read (zeros before its first count, made nowhere)."""
        return self.families.get(name) or FamilyStats()

    # The runner-wide names of one family's counters (read only: each family counts into its own).
    captures = _counter_of("full", "captures")
    warmup_captures = _counter_of("full", "warmup_captures")
    replays = _counter_of("full", "replays")
    replays_by_q_len = _counter_of("full", "replays_by_q_len")
    piecewise_captures = _counter_of("piecewise", "captures")
    piecewise_replays = _counter_of("piecewise", "replays")

    @property
    def real_tokens(self) -> int:
        return sum(counts.real_tokens for counts in self.families.values())

    @property
    def padded_tokens(self) -> int:
        return sum(counts.padded_tokens for counts in self.families.values())

    @property
    def replays_by_variant(self) -> Counter:
        return sum((counts.replays_by_variant for counts in self.families.values()), Counter())

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens graphs computed that were padding."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def summary(self) -> str:
        eager = ", ".join(f"{n} {reason}" for reason, n in sorted(self.eager_steps.items())) or "none"
        compiled = f"; compile {self.compile_seconds:.1f} s" if self.compile_seconds else ""
        for name, counts in self.families.items():  # every family beside the full graphs, by name
            if name != "full" and (counts.captures or counts.replays):
                compiled += f"; {name}: {counts.captures} captures, {counts.replays} replays"
        replays = f"{self.replays} replays"
        if any(q_len > 1 for q_len in self.replays_by_q_len):
            by_q_len = ", ".join(f"{n} of q_len {q_len}" for q_len, n in sorted(self.replays_by_q_len.items()))
            replays += f" ({by_q_len})"
        return (
            f"{self.captures} captures ({self.warmup_captures} in warm-up), {replays}, eager steps: {eager}; "
            f"padding {self.padded_tokens}/{self.real_tokens + self.padded_tokens} tokens "
            f"({self.padding_fraction:.1%}){compiled}{self._by_variant()}{self._derived()}{self._verify_reads()}"
            f"{self._slept()}"
        )

    def _slept(self) -> str:
        """"; 2 sleeps, 2 wakes (18 graphs captured again)", once the runner slept."""
        if not self.sleeps:
            return ""
        return f"; {self.sleeps} sleeps, {self.wakes} wakes ({self.recaptures} graphs captured again)"

    def _derived(self) -> str:
        """"; 3 host copies derived (kv_seqlens_cpu not passed)", when any was."""
        if not self.derived_host_copies:
            return ""
        return f"; {self.derived_host_copies} host copies derived (kv_seqlens_cpu not passed)"

    def _verify_reads(self) -> str:
        """"; 5 verify steps' query lengths read to the host", when any were."""
        if not self.verify_length_reads:
            return ""
        return f"; {self.verify_length_reads} verify steps' query lengths read to the host"

    def _by_variant(self) -> str:
        """"; graph replays by variant: 3 plain, 2 lora=True", when any is not plain."""
        if all(label == PLAIN for label in self.replays_by_variant):
            return ""
        counts = sorted(self.replays_by_variant.items(), key=lambda item: (item[0] != PLAIN, item[0]))
        return "; graph replays by variant: " + ", ".join(f"{n} {label}" for label, n in counts)
