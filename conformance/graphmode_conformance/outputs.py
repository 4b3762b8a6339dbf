"""Models returning several tensors: every output tensor equals eager.

Engines' models return more than logits: a tuple of logits and
log-probabilities, a dict with hidden states. ``graphmode_get_outputs`` must
cut every tensor of the structure to the live tokens, not the first only;
the single-tensor checks elsewhere cannot see a hook that cuts the first and
returns the others with the bucket's padding rows. Here the reference model's
logits come back as a tuple ``(logits, log_softmax(logits))`` and as a dict
``{"logits", "logprobs", "hidden"}``, in every execute mode, and every tensor
is compared with eager's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure
from graphmode_conformance.modes import EXECUTE_MODES, ModeHarness, build_in_mode, mixed_steps

__all__ = ["MultiOutputTests", "SeveralOutputs"]


class SeveralOutputs(torch.nn.Module):
    """The reference model returning several per-token tensors, as a tuple
    or a dict (``structure``); each is (1, tokens, ...) as logits are."""

    def __init__(self, model: Any, structure: str) -> None:
        super().__init__()
        self.inner, self.ops, self.config, self.structure = model, model.ops, model.config, structure

    def make_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_kv_cache(*args, **kwargs)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.structure == "tuple":
            return logits, logprobs
        hidden = torch.tanh(logits[..., : self.config.hidden_size // 2]) * 2  # a per-token tensor of another width
        return {"logits": logits, "logprobs": logprobs, "hidden": hidden}


class MultiOutputHarness(ModeHarness):
    """Outputs compared tensor by tensor; a tensor not cut to the live tokens
    while the first one is names ``graphmode_get_outputs``."""

    def _check_outputs(
        self, where: str, graph: Any, eager: Any, seqs: list[int], phase: str, raw: Any = None,
    ) -> None:
        graph_leaves, graph_spec = tree_flatten_with_path(graph)
        eager_leaves, eager_spec = tree_flatten_with_path(eager)
        if graph_spec != eager_spec:
            raise ConformanceFailure(
                f"{where}: the graph returned {_structure(graph)}, eager {_structure(eager)}. Likely cause: "
                "graphmode_get_outputs must return the structure the model returned (every tensor of a tuple or "
                "dict, cut to the live tokens)"
            )
        first_right = None
        for (path, ours), (_, theirs) in zip(graph_leaves, eager_leaves):
            name = f"output{keystr(path)}"
            if isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor) and ours.shape != theirs.shape \
                    and first_right is not None:
                raise ConformanceFailure(
                    f"{where}: {name} has shape {tuple(ours.shape)}, eager {tuple(theirs.shape)}, while {first_right} "
                    f"has eager's shape. Likely cause: graphmode_get_outputs cut only some tensors of the model's "
                    f"{self.model.structure} to the live tokens; every per-token tensor (dimension 1 the step's "
                    "tokens) must be cut to num_tokens, e.g. with torch.utils._pytree.tree_map"
                )
            super()._check_outputs(f"{where}, {name}", ours, theirs, seqs, phase)
            first_right = first_right or name


    def describe_error(self, error: BaseException) -> str:
        """A hook that fails on the model's tuple or dict is told that
        ``meta.output_buffers["output"]`` holds what the forward returned."""
        described = super().describe_error(error)
        if " in graphmode_get_outputs " not in described:
            return described
        return (
            f"{described}. The model returns a {self.model.structure} here: meta.output_buffers['output'] is "
            f"what the captured forward returned, a tensor or a tuple, list or dict of them, so "
            "graphmode_get_outputs must cut every tensor of it to num_tokens; to change the outputs, wrap the "
            "default (@hookimpl(wrapper=True): outputs = yield) rather than replacing it (docs/hooks.md)"
        )


def _structure(value: Any) -> str:
    leaves, spec = tree_flatten(value)
    return f"{type(value).__name__} of {len(leaves)} leaves ({spec})"


class MultiOutputTests(ConformanceFixtures):
    @pytest.mark.parametrize("structure", ["tuple", "dict"])
    @pytest.mark.parametrize("mode", EXECUTE_MODES)
    def test_every_output_tensor_of_a_model_returning_several(self, build_harness, sizes, mode, structure):
        harness = build_in_mode(build_harness, sizes, mode, MultiOutputHarness,
                                wrap=lambda model: SeveralOutputs(model, structure))
        harness.check = f"every output of a {structure} equals eager"
        mixed_steps(harness)
