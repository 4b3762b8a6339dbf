"""The vendor's kernels against graphmode's reference kernels.

Graph-equals-eager compares the vendor with itself: a kernel that computes
the wrong thing in graphs and eagerly alike passes it. Here the same model,
with the same weights, runs eager steps once on the vendor's attention ops and
once on :class:`graphmode.attention.ReferenceAttentionOps`, each with a KV cache
in its own layout, and their logits must agree.
"""

from __future__ import annotations

import pytest
import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.families.piecewise.breaks import kernels_taking_out
from graphmode.model import ModelConfig, build_reference_model
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure

__all__ = ["KernelTests"]

# Two kernels, not one kernel twice: a float32 kernel may sum in another order.
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# A context past 1024 tokens: decode kernels split long contexts into partitions and merge
# them (split-KV); the harness's graphs hold at most table width x block size (128) tokens.
LONG = 1024
_LONG_CHUNKS = (400, 300, 200, 128)  # LONG + 4 tokens
# The 16-bit cache dtypes engines serve with: same width, other bits (a kernel
# built for one reads the other's cache as garbage, with no error).
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
        steps = [("prefill", engine.prefill(seqs, [1, 7, 16, 23, 40]), "")]
        steps += [(f"decode {i + 1}", engine.decode(seqs), "") for i in range(3)]
        # A mixed step: four decodes and a chunk of the fifth, each sequence with a cached prefix of its own.
        steps += [("mixed (4 decodes, a chunk of 9)", engine.prefill(seqs, [1, 1, 1, 1, 9]),
                   "; in a mixed step: a causal offset (kv length - query length) taken for the whole batch "
                   "rather than per sequence, or q_seqlens and kv_seqlens mixed up")]
        # Decode steps of several tokens per sequence (speculative verify, MTP), where the vendor's
        # graphs take them: each new token sees its sequence's cache up to its own position.
        # As many tokens per sequence as the vendor declares it takes (GraphSpec.max_q_len), 4 at most.
        top = 4 if vendor.spec.max_q_len is None else min(vendor.spec.max_q_len, 4)
        if top > 1:
            steps += [(f"decode of {q_len} tokens per sequence", engine.decode(seqs, q_len),
                       f"; in a decode step of {q_len} new tokens per sequence (speculative verify, MTP): each "
                       "new token must see its sequence's cache up to its own position, causal among the new "
                       "tokens (FlashAttention's causal=True, whose default is False; FIA's sparse_mode 3)")
                      for q_len in sorted({2, top})]
        # Sizes a kernel may split its work at (launches of 32 sequences, a path above 512 tokens): a
        # decode of 40 sequences, and a prefill of 640 tokens over three sequences.
        wide = [engine.add() for _ in range(35)]
        steps += [("prefill of 35 sequences", engine.prefill(wide, [3] * 35), ""),
                  ("decode of 40 sequences", engine.decode([*seqs, *wide]),
                   "; in a decode of 40 sequences: a path taken above some batch (launches of so many "
                   "sequences, each given the lengths and tables of its own rows)")]
        many = [engine.add() for _ in range(3)]
        steps += [("prefill of 640 tokens over 3 sequences", engine.prefill(many, [200, 240, 200]),
                   "; in a prefill of 640 tokens: a path taken above some token count (each sequence's "
                   "tokens at their own slots, not one run of consecutive slots)")]
        # A context past LONG tokens, prefilled in chunks, then decoded beside the short sequences.
        # Chunks of four sizes: shapes that repeat with other lengths are the planning-state test's.
        long = engine.add()
        steps += [(f"chunk {i + 1} of a {LONG + 4}-token prefill", engine.prefill([long], [chunk]),
                   "; with a long context: a path taken above some length only")
                  for i, chunk in enumerate(_LONG_CHUNKS)]
        steps += [(f"decode {i + 1} with a {LONG + 4}-token context", engine.decode([*seqs, long]),
                   "; with a long context: a path taken above some length only (split-KV partitions "
                   "and their merge)") for i in range(2)]
        with torch.inference_mode():
            for name, step, hint in steps:
                args = (step.input_ids, step.position_ids)
                ours = model(*args, caches["vendor"], step.attn_metadata).float()
                theirs = reference(*args, caches["reference"], step.attn_metadata).float()
                # Each decode step's inputs depend on the previous ones only through the caches.
                difference = (ours - theirs).abs().max().item()
                if not difference <= tolerance * max(1.0, theirs.abs().max().item()):
                    token = int((ours - theirs).abs().amax(dim=-1)[0].argmax())
                    kernel = _kernel_at_fault(model, reference, caches, step, name.startswith("decode"))
                    raise ConformanceFailure(
                        f"[kernels] vendor {vendor.name}: on the {name} step (eager, kv lengths {step.attn_metadata.kv_seqlens.tolist()}) the vendor's "
                        f"attention ops give logits differing from graphmode's reference kernels by {difference:.3g} "
                        f"(tolerance {tolerance:g} relative to the largest logit), most at token {token}. {kernel}{hint}"
                    )

    def test_the_kernels_read_each_16_bit_cache_as_its_own_dtype(self, harness, vendor):
        """The same check in float16 and in bfloat16, whatever the suite's
        ``--dtype``: model, weights and KV cache in that dtype, a prefill and
        two decode steps on the vendor's ops and on the reference kernels.
        float16 and bfloat16 have the same width, so a kernel that takes one
        for the other (a ``.view(torch.float16)`` of a bfloat16 cache, a
        kernel built for half only given the cache's pointer) reads every
        cached value as another number, with no error."""
        right, wrong = [], {}
        for dtype in HALF_DTYPES:
            config = ModelConfig.tiny(dtype)
            options = getattr(harness.runner.config, "vendor_options", None)
            ours = build_reference_model(config, vendor, harness.device, seed=3, vendor_options=options)
            theirs = build_reference_model(config, ops=ReferenceAttentionOps(), device=harness.device, seed=3)
            engine = type(harness.engine)(harness.sizes.cache_blocks, harness.sizes.block, harness.device,
                                          vocab_size=config.vocab_size, table_width=None, seed=5)
            caches = [model.make_kv_cache(harness.sizes.cache_blocks, harness.sizes.block) for model in (ours, theirs)]
            seqs = [engine.add() for _ in range(3)]
            steps = [("prefill", engine.prefill(seqs, [5, 17, 30]))]
            steps += [(f"decode {i + 1}", engine.decode(seqs)) for i in range(2)]
            tolerance = _TOLERANCE[dtype]
            with torch.inference_mode():
                for name, step in steps:
                    args = (step.input_ids, step.position_ids)
                    got = ours(*args, caches[0], step.attn_metadata).float()
                    want = theirs(*args, caches[1], step.attn_metadata).float()
                    difference = (got - want).abs().max().item()
                    if not difference <= tolerance * max(1.0, want.abs().max().item()):
                        wrong[dtype] = (name, difference, tolerance)
                        break
                else:
                    right.append(dtype)
        if not wrong:
            return
        dtype, (name, difference, tolerance) = next(iter(wrong.items()))
        named = str(dtype).removeprefix("torch.")
        if right:
            other = str(right[0]).removeprefix("torch.")
            how = (f"with a {other} cache the same steps agree: the {named} cache is read as {other} (same width, "
                   f"other bits: a .view(torch.{other}) of the cache, or a kernel built for {other} only given the "
                   f"cache's pointer). Hook: graphmode_attention_ops must read the cache in its own dtype "
                   f"(k_cache.dtype), or refuse a dtype its kernels do not take with an error naming it")
        else:
            how = ("with either 16-bit cache the steps differ: the kernels compute another result in 16 bits than in "
                   "their reference (an accumulation in the cache's dtype, a cast of the cache to another 16-bit "
                   "type). Hook: graphmode_attention_ops")
        raise ConformanceFailure(
            f"[kernels] vendor {vendor.name}{harness.variant}: with the model and its KV cache in {named}, the "
            f"{name} step (eager) gives logits differing from graphmode's reference kernels by {difference:.3g} "
            f"(tolerance {tolerance:g} relative to the largest logit); {how}"
        )

    def test_the_kernels_use_the_scale_they_are_given(self, harness, vendor):
        """The reference model always passes ``head_dim**-0.5``; models pass
        their own (Gemma's query_pre_attn_scalar, MLA's softmax scale, a
        scaled rotary's mscale). Each kernel, on the same keys and values
        written by each side's own ``fill_kv_cache``, with another scale,
        must compute what the reference kernel computes with it."""
        model, engine, sizes = harness.model, harness.engine, harness.sizes
        config = model.config
        reference = build_reference_model(config, ops=ReferenceAttentionOps(), device=harness.device)
        ours_cache = model.make_kv_cache(sizes.cache_blocks, sizes.block)[0]
        theirs_cache = reference.make_kv_cache(sizes.cache_blocks, sizes.block)[0]
        generator = torch.Generator(device="cpu").manual_seed(1)
        scale = 0.6 * config.head_dim**-0.5
        tolerance = _TOLERANCE.get(config.dtype, 5e-2)

        def random(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(config.dtype).to(harness.device)

        seqs = [engine.add() for _ in range(3)]
        with torch.inference_mode():
            for name, step in (("prefill_attention", engine.prefill(seqs, [7, 16, 23])),
                               ("paged_decode_attention", engine.decode(seqs))):
                tokens = step.num_tokens
                key, value = (random(tokens, config.num_key_value_heads, config.head_dim) for _ in range(2))
                model.ops.fill_kv_cache(key, value, *ours_cache, step.attn_metadata)
                reference.ops.fill_kv_cache(key, value, *theirs_cache, step.attn_metadata)
                query = random(tokens, config.num_attention_heads, config.head_dim)
                ours = getattr(model.ops, name)(query, *ours_cache, step.attn_metadata, scale).float()
                theirs = getattr(reference.ops, name)(query, *theirs_cache, step.attn_metadata, scale).float()
                difference = (ours - theirs).abs().max().item()
                if not difference <= tolerance * max(1.0, theirs.abs().max().item()):
                    raise ConformanceFailure(
                        f"[kernels] vendor {vendor.name}: {name} with scale {scale:.4g} (0.6 x head_dim**-0.5) "
                        f"differs from graphmode's reference kernel with the same scale by {difference:.3g} "
                        f"(tolerance {tolerance:g}). Likely cause: the kernel ignores the scale it is given "
                        "(head_dim**-0.5 computed inside, the default of a vendor kernel's softmax_scale), which "
                        "only the reference model's own scale hides. Hook: graphmode_attention_ops"
                    )

    def test_a_kernel_taking_out_writes_what_it_returns_without_it(self, harness, vendor):
        """``prefill_attention`` and ``paged_decode_attention`` may take
        ``out=`` (piecewise graphs then pass the buffer the next segment
        reads): written there, the result must be what the call returns
        without ``out``, every row of it."""
        model, engine = harness.model, harness.engine
        kernels = kernels_taking_out(model.ops)
        if not kernels:
            pytest.skip("the vendor's attention kernels take no out=")
        cache = model.make_kv_cache(harness.sizes.cache_blocks, harness.sizes.block)
        seqs = [engine.add() for _ in range(4)]
        prefill = engine.prefill(seqs, [3, 9, 1, 17])
        config = model.config
        generator = torch.Generator(device="cpu").manual_seed(0)
        with torch.inference_mode():
            model(prefill.input_ids, prefill.position_ids, cache, prefill.attn_metadata)  # the cache to attend to
            decode = engine.decode(seqs)
            model(decode.input_ids, decode.position_ids, cache, decode.attn_metadata)
            for name, step in (("prefill_attention", prefill), ("paged_decode_attention", decode)):
                if name not in kernels:
                    continue
                kernel = getattr(model.ops, name)
                shape = (step.num_tokens, config.num_attention_heads, config.head_dim)
                query = torch.randn(shape, generator=generator).to(model.config.dtype).to(harness.device)
                k_cache, v_cache = cache[0]
                scale = config.head_dim**-0.5
                expected = kernel(query, k_cache, v_cache, step.attn_metadata, scale)
                out = torch.full_like(query, float("nan"))
                returned = kernel(query, k_cache, v_cache, step.attn_metadata, scale, out=out)
                if returned is not None and returned.data_ptr() != out.data_ptr():
                    raise ConformanceFailure(
                        f"[kernels] vendor {vendor.name}: {name}(out=) returned a tensor other than out; it must "
                        "write its result into out and return out (or None)"
                    )
                wrong = ~torch.isclose(out.float(), expected.float(), atol=1e-3, rtol=1e-2).flatten(1).all(dim=1)
                if not wrong.any():
                    continue
                rows = f"{name}(out=) wrote rows {wrong.nonzero().flatten().tolist()[:8]} of {shape[0]}"
                # An out holding ones: does the kernel add its result to what out held?
                ones = torch.ones_like(query)
                kernel(query, k_cache, v_cache, step.attn_metadata, scale, out=ones)
                if torch.allclose(ones.float(), expected.float() + 1, atol=1e-3, rtol=1e-2):
                    raise ConformanceFailure(
                        f"[kernels] vendor {vendor.name}: {rows} differently from the result it returns without out: "
                        "it adds its result to what out held (an out of ones came back as the result + 1). Likely "
                        "cause: the out= path accumulates into out (out += ..., a split-KV merge that assumes a "
                        "zeroed out); piecewise graphs pass rows of a buffer holding the previous step's attention, "
                        "so their attention would be wrong. Hook: graphmode_attention_ops: the out= path must "
                        "overwrite out, never read it"
                    )
                raise ConformanceFailure(
                    f"[kernels] vendor {vendor.name}: {rows} differently from the result it returns without out. "
                    "Likely cause: the kernel's out= path writes part of the rows, or another layout, than its "
                    "result; piecewise graphs read out, so their attention would be wrong. Hook: "
                    "graphmode_attention_ops"
                )


def _kernel_at_fault(model, reference, caches: dict, step, decode: bool) -> str:
    """Which kernel of graphmode_attention_ops a differing step points at: the
    cache write when the vendor's first-layer cache, read through its
    ``block_view``, differs from the reference's at the slots this step
    writes (the first layer's keys and values depend on the step's tokens
    alone; later layers' on the attention before them); else the step's
    attention kernel."""
    slots = step.attn_metadata.kv_start_indices.reshape(-1).long()
    slots = slots[slots >= 0]
    head_dim = model.config.head_dim
    for layer, (ours, theirs) in enumerate(zip(caches["vendor"][:1], caches["reference"][:1])):
        for half, mine, want in (("key", ours[0], theirs[0]), ("value", ours[1], theirs[1])):
            got = model.ops.block_view(mine, head_dim).reshape(-1, want.shape[-2] * head_dim)[slots].float()
            expected = reference.ops.block_view(want, head_dim).reshape(-1, want.shape[-2] * head_dim)[slots].float()
            if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
                untouched = " (they hold zeros: nothing reached the cache passed)" if not got.any() else ""
                return (f"Likely cause: graphmode_attention_ops's fill_kv_cache: after this step the {half} cache of layer {layer}, read "
                        f"through block_view, differs from the reference kernels' at the {len(slots)} slots the step "
                        f"writes{untouched}: a write into a copy (torch.stack, reshape or .contiguous() of a cache, a "
                        "fused tensor rebuilt from its key and value halves) or into other slots")
    attention = "paged_decode_attention" if decode else "prefill_attention"
    return (f"The caches agree at this step's slots (fill_kv_cache wrote them as the reference does). Likely cause: "
            f"graphmode_attention_ops's {attention} computes something else than its contract (masking, scale, head "
            "mapping, softmax, the lengths or starts it derives)")
