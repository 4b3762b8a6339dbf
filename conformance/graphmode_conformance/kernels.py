"""The vendor's kernels against graphmode's reference kernels.

Graph-equals-eager compares the vendor with itself: a kernel that computes
the wrong thing in graphs and eagerly alike passes it. Here the same model,
with the same weights, runs eager steps once on the vendor's attention ops and
once on :class:`graphmode.model.ReferenceAttentionOps`, each with a KV cache
in its own layout, and their logits must agree.
"""

from __future__ import annotations

import torch

from graphmode.model import ReferenceAttentionOps, build_reference_model
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure

__all__ = ["KernelTests"]

# Two kernels, not one kernel twice: a float32 kernel may sum in another order.
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class KernelTests(ConformanceFixtures):
    def test_the_kernels_compute_what_the_reference_kernels_compute(self, harness, vendor):
        model, engine, sizes = harness.model, harness.engine, harness.sizes
        reference = build_reference_model(model.config, ops=ReferenceAttentionOps(), device=harness.device)
        reference.load_state_dict(model.state_dict())
        caches = {
            "vendor": model.make_kv_cache(sizes.cache_blocks, sizes.block),
            "reference": reference.make_kv_cache(sizes.cache_blocks, sizes.block),
        }
        tolerance = _TOLERANCE.get(model.config.dtype, 5e-2)
        seqs = [engine.add() for _ in range(5)]
        steps = [("prefill", engine.prefill(seqs, [1, 7, 16, 23, 40]))]
        steps += [(f"decode {i + 1}", engine.decode(seqs)) for i in range(3)]
        with torch.inference_mode():
            for name, step in steps:
                args = (step.input_ids, step.position_ids)
                ours = model(*args, caches["vendor"], step.attn_metadata).float()
                theirs = reference(*args, caches["reference"], step.attn_metadata).float()
                # Each decode step's inputs depend on the previous ones only through the caches.
                difference = (ours - theirs).abs().max().item()
                if not difference <= tolerance * max(1.0, theirs.abs().max().item()):
                    token = int((ours - theirs).abs().amax(dim=-1)[0].argmax())
                    raise ConformanceFailure(
                        f"[kernels] vendor {vendor.name}: on the {name} step (eager, 5 sequences) the vendor's "
                        f"attention ops give logits differing from graphmode's reference kernels by {difference:.3g} "
                        f"(tolerance {tolerance:g} relative to the largest logit), most at token {token}. Likely "
                        "cause: a kernel of graphmode_attention_ops (fill_kv_cache, prefill_attention, "
                        "paged_decode_attention) computes something else than its contract (masking, scale, "
                        "head mapping, softmax)"
                    )
