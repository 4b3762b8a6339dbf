"""Harnesses in every execute mode: full graphs ("graph"), piecewise graphs
around eager attention ("piecewise"), and both ("full_and_piecewise")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphmode.context import StepInputs
from graphmode_conformance.harness import Harness, piecewise_of
from graphmode_conformance.piecewise import BATCH_SIZES, TOKEN_SIZES, _smaller
from graphmode_conformance.sizes import Sizes

__all__ = ["EXECUTE_MODES", "ModeHarness", "build_in_mode", "mixed_steps"]

EXECUTE_MODES = ["graph", "piecewise", "full_and_piecewise"]


class ModeHarness(Harness):
    """The harness with checked steps of any kind (prefill, chunked prefill,
    decode) in any execute mode."""

    def step_variant(self) -> dict[str, Any]:
        """The graph variant keywords of the step being checked (the runner's
        ``graph_variants``); none: the plain graphs."""
        return {}

    def checked(self, seqs: list[int], inputs: StepInputs) -> None:
        """One step through the runner and eagerly, outputs and cache checked."""
        runner = self.runner
        mode = runner.config.execute_mode
        variant = self.step_variant()
        if inputs.attn_metadata.is_decoding and mode != "piecewise" and runner.bucket_of(len(seqs)) is not None:
            bucket: int | None = runner.bucket_of(len(seqs))
            kind = f"batch {len(seqs)}, bucket {bucket}"
            phase = "capture" if bucket is None or runner.graph(bucket, **variant) is None else "replay"
        elif mode != "graph" and (pieces := piecewise_of(runner)) is not None:
            bucket = pieces.bucket_of(inputs.num_tokens)
            kind = f"{inputs.num_tokens} tokens of {len(seqs)} sequences, token bucket {bucket}"
            captured = bucket is not None and pieces.graph(bucket, **variant) is not None
            phase = "replay" if captured else "capture"
        else:
            kind, phase = f"{inputs.num_tokens} tokens of {len(seqs)} sequences", "eager"
        kind += "".join(f", {name}={value!r}" for name, value in variant.items())
        per_token = [s for s, n in zip(seqs, inputs.attn_metadata.q_seqlens.tolist()) for _ in range(n)]
        self._compared(
            inputs, phase, per_token,
            lambda step: f"vendor {self.vendor.name} on {self.device}{self.variant}, {mode}, {kind}, step {step} ({phase})",
        )

    def prefill(self, seqs: list[int], lengths: list[int]) -> None:
        self.checked(seqs, self.engine.prefill(seqs, lengths))

    def decode(self, seqs: list[int]) -> None:
        self.checked(seqs, self.engine.decode(seqs))


def build_in_mode(
    build_harness: Callable[..., Harness], sizes: Sizes, mode: str, cls: type[ModeHarness] = ModeHarness, **options: Any,
) -> Any:
    """A harness of ``cls`` in execute mode ``mode``, at the piecewise tests'
    sizes (at most 12 sequences; token buckets 2, 8, 24, 64)."""
    if mode != "graph":
        options.setdefault("capture_token_sizes", TOKEN_SIZES)
    harness = build_harness(cls, _smaller(sizes), execute_mode=mode, capture_batch_sizes=BATCH_SIZES, **options)
    assert isinstance(harness, cls)  # Harness.build makes the class it is called on
    return harness


def mixed_steps(harness: ModeHarness) -> None:
    """Checked steps of every kind: a prefill of 8 sequences, decodes padded
    into buckets 4 and 8 (replays after captures), then a mixed step."""
    engine = harness.engine
    seqs = [engine.add() for _ in range(8)]
    harness.prefill(seqs, [3, 9, 1, 17, 5, 2, 11, 6])
    for batch in (8, 3, 8, 5, 3):
        harness.decode(seqs[:batch])
    newcomer = engine.add()
    harness.prefill([*seqs[:3], newcomer], [1, 1, 1, 7])
