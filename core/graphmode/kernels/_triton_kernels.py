"""The Triton kernels behind :mod:`graphmode.kernels.triton_decode`.

Imported only when a kernel first runs: importing this module imports
Triton. ``TRITON_INTERPRET=1`` must be set before that import for the
kernels to run on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


# The partition count is a runtime argument, not a constant, and is not
# specialised on: it differs between most batch buckets, and as a constant
# the default buckets to 256 compiled a partition kernel and a merge per
# distinct count (on an H100 at the bench model's shapes: 7 counts, 14
# kernels), where they now compile one partition kernel, and a merge per
# power-of-two bound on the count (5).
@triton.jit(do_not_specialize=["splits"])
def decode_partition_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    capacity, tokens_per_split, splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (sequence, KV head, partition of the KV length) per program: the
    GROUP query heads sharing that KV head attend over the partition's
    tokens with an online softmax in float32 (base 2).

    With one partition (``PARTIAL`` false) the normalised result goes
    straight to ``out``; otherwise the unnormalised accumulator and its
    (max, sum) go to the partial buffers for :func:`combine_kernel`. A
    partition past the sequence's length writes an empty partial (max -inf,
    sum 0)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.load(lens_ptr + seq)
    length = tl.minimum(tl.maximum(length, 0), capacity)  # the reference reads no further than the table
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, length)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        in_range = tokens < hi
        block = tl.load(table + tokens // PAGE, mask=in_range, other=0).to(tl.int64)
        # The reserved block 0 belongs to no sequence: never read, whatever it holds
        # (padding rows, whose table is all block 0, read nothing and get zeros).
        live = in_range & (block != 0)
        offset = (tokens % PAGE).to(tl.int64)
        mask = live[:, None] & dim_ok[None, :]
        k_rows = block * stride_kn + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: weights 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_vn + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if not PARTIAL:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # nothing visible: zeros, as the reference
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        # partials are (B, H, splits, BLOCK_D) and (B, H, splits, 2), contiguous
        row = (seq * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * splits + split
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=head_ok)


@triton.jit(do_not_specialize=["splits"])
def combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_heads, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (sequence, query head) per program: merge the partitions'
    partial softmaxes into the normalised output, CHUNK partitions at a
    time (registers bounded by CHUNK x BLOCK_D whatever the count)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    first = (seq * num_heads + head).to(tl.int64) * splits
    m_run = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, splits, CHUNK):
        parts = start + tl.arange(0, CHUNK)
        part_ok = parts < splits
        row = first + parts
        m = tl.load(part_ml_ptr + row * 2, mask=part_ok, other=float("-inf"))
        l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=part_ok, other=0.0)
        part_acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], mask=part_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every partition so far empty: weights 0
        rescale = tl.exp2(m_run - m_safe)
        weight = tl.exp2(m - m_safe)
        l_run = l_run * rescale + tl.sum(l_part * weight, 0)
        acc = acc * rescale + tl.sum(part_acc * weight[:, None], 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)  # every partition empty: output 0
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One token per program: its key and value (KV_HEADS, HEAD_DIM) to its
    slot; slot < 0 writes nothing."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads < KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
        value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
                        mask=mask)
        k_dest = k_cache_ptr + block * stride_kn + offset * stride_kt + heads[:, None] * stride_kh + dims[None, :]
        v_dest = v_cache_ptr + block * stride_vn + offset * stride_vt + heads[:, None] * stride_vh + dims[None, :]
        tl.store(k_dest, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dest, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, scale_log2, visible, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One block of keys and values into an online softmax (base 2): the
    new running maximum, sum and accumulator. Scores stay unscaled: the
    scale joins the subtraction of the running maximum in one multiply-add
    (as flash attention does). ``visible`` (rows x keys) masks scores when
    ``MASKED``; a row that sees nothing yet keeps weights 0, not NaN."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(scores * scale_log2 - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, starts_ptr, q_lens_ptr, kv_lens_ptr,
    q_desc, k_desc, v_desc,
    scale_log2, num_seqs, num_tokens, capacity,
    stride_qt, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    DESC: tl.constexpr,
):
    """One (sequence, block of BLOCK_Q of its new tokens, HEADS of the
    GROUP query heads of one KV head) per program: those rows (BLOCK_Q x
    HEADS, a head past the group masked) attend causally over the
    sequence's cached tokens, read through its block table, with an online
    softmax in float32 (base 2). Axis 2 of the grid counts KV heads times
    ceil(GROUP / HEADS). A token at
    index i of the sequence's ``q_len`` new tokens sits at position
    ``kv_len - q_len + i`` and sees the cached positions up to its own.

    With ``DESC`` (Hopper and later; HEADS 1, BLOCK_N == PAGE, BLOCK_D ==
    HEAD_DIM) queries and whole pages of keys and values come through
    tensor descriptors (``q_desc`` over the (tokens, heads, dim) queries,
    ``k_desc`` and ``v_desc`` over the (blocks, page, kv_heads, dim)
    caches): the copy engine fetches them into shared memory, no address
    per element. Otherwise through pointers.

    Lengths are read on the device: a program past its sequence's tokens
    does nothing. The extra sequence index ``num_seqs`` zeroes the rows after
    the last sequence's tokens (the padding of a token bucket)."""
    seq = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest (last) blocks start first
    per_kv_head = (GROUP + HEADS - 1) // HEADS  # programs sharing one KV head
    kv_head = tl.program_id(2) // per_kv_head
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    rows = tl.arange(0, BLOCK_Q * HEADS)
    group = tl.program_id(2) % per_kv_head * HEADS + rows % HEADS
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    if seq == num_seqs:
        if q_block == 0:
            last = num_seqs - 1
            end = tl.load(starts_ptr + last) + tl.load(q_lens_ptr + last)
            zeros = tl.zeros([BLOCK_Q * HEADS, BLOCK_D], dtype=out_ptr.dtype.element_ty)
            for first in range(end, num_tokens, BLOCK_Q):
                token = first + rows // HEADS
                ok = (token < num_tokens) & head_ok
                out_rows = token.to(tl.int64) * stride_ot + heads * stride_oh
                tl.store(out_ptr + out_rows[:, None] + dims[None, :], zeros, mask=ok[:, None] & dim_ok[None, :])
    else:
        q_len = tl.load(q_lens_ptr + seq)
        first = q_block * BLOCK_Q
        if first < q_len:
            start = tl.load(starts_ptr + seq)
            kv_len = tl.minimum(tl.load(kv_lens_ptr + seq), capacity)  # the table bounds what is read
            token = first + rows // HEADS
            row_ok = (token < q_len) & head_ok
            position = kv_len - q_len + token
            if DESC:  # rows past the sequence read other rows (or zeros): never stored
                q = q_desc.load([start + first, kv_head * GROUP + tl.program_id(2) % per_kv_head, 0])
                q = q.reshape(BLOCK_Q, BLOCK_D)
            else:
                q_rows = (start + token).to(tl.int64) * stride_qt + heads * stride_qh
                q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                            other=0.0)

            m_i = tl.full([BLOCK_Q * HEADS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_Q * HEADS], dtype=tl.float32)
            acc = tl.zeros([BLOCK_Q * HEADS, BLOCK_D], dtype=tl.float32)
            table = table_ptr + seq.to(tl.int64) * stride_tb
            hi = tl.minimum(kv_len, kv_len - q_len + first + BLOCK_Q)  # past the block's last position
            # Key blocks every row of the program sees in full (below its
            # first token's position) need no mask: most of a long prompt's.
            full = tl.maximum(kv_len - q_len + first + 1, 0) // BLOCK_N * BLOCK_N
            for key_start in range(0, full, BLOCK_N):
                if DESC:
                    page = tl.load(table + key_start // PAGE)
                    k = k_desc.load([page, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
                    v = v_desc.load([page, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
                else:
                    keys = key_start + tl.arange(0, BLOCK_N)
                    block = tl.load(table + keys // PAGE).to(tl.int64)
                    offset = (keys % PAGE).to(tl.int64)
                    k_rows = block * stride_kn + offset * stride_kt + kv_head * stride_kh
                    k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=dim_ok[None, :], other=0.0)
                    v_rows = block * stride_vn + offset * stride_vt + kv_head * stride_vh
                    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=dim_ok[None, :], other=0.0)
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, scale_log2, None, False, PRECISION)
            for key_start in range(full, hi, BLOCK_N):  # the diagonal: causal and length masks
                keys = key_start + tl.arange(0, BLOCK_N)
                in_range = keys < hi
                if DESC:
                    page = tl.load(table + key_start // PAGE)
                    k = k_desc.load([page, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
                    # A page's slots past the length hold anything, NaN
                    # included: a zero weight times NaN would still be NaN.
                    v = v_desc.load([page, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
                    v = tl.where(in_range[:, None], v, 0.0)
                else:
                    block = tl.load(table + keys // PAGE, mask=in_range, other=0).to(tl.int64)
                    offset = (keys % PAGE).to(tl.int64)
                    mask = in_range[:, None] & dim_ok[None, :]
                    k_rows = block * stride_kn + offset * stride_kt + kv_head * stride_kh
                    k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=mask, other=0.0)
                    v_rows = block * stride_vn + offset * stride_vt + kv_head * stride_vh
                    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=mask, other=0.0)
                visible = in_range[None, :] & (keys[None, :] <= position[:, None])
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, scale_log2, visible, True, PRECISION)
            result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # nothing visible: zeros, as the reference
            out_rows = (start + token).to(tl.int64) * stride_ot + heads * stride_oh
            tl.store(out_ptr + out_rows[:, None] + dims[None, :], result.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & dim_ok[None, :])
