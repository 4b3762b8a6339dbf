"""The reserved padding block may hold anything (a cache made with
``torch.empty``: NaN, say): padding rows read it and live rows' tables point
at it past their blocks, and neither may change a live result."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode.plugins.manager import installed_vendor_names


@pytest.mark.parametrize("vendor", installed_vendor_names())
def test_nan_in_the_reserved_block_never_reaches_a_result(vendor):
    setup = tiny_setup(vendor, capture_batch_sizes=[4, 8])
    for key, value in setup.graph_cache:  # block 0 of every cache tensor, through the vendor's layout
        for tensor in (key, value):
            setup.model.ops.block_view(tensor, setup.model.config.head_dim)[0].fill_(float("nan"))
    seqs = setup.prefill(6, [3, 20, 9, 17, 5, 30])  # one or two blocks: tables end in block 0
    for batch in (3, 3, 6, 5, 5, 2, 3):  # padded into buckets 4 and 8, with churn
        replays = setup.runner.stats.replays
        graph, eager = setup.decode(seqs[:batch])
        assert torch.isfinite(graph).all(), f"{vendor}: NaN in a live row at batch {batch}"
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"{vendor}, batch {batch}")
        if setup.runner.stats.replays > replays:  # the whole bucket's result, padding rows included
            bucket = setup.runner.bucket_of(batch)
            output = setup.runner.graph(bucket).meta.output_buffers["output"][:, :bucket]
            assert torch.isfinite(output).all(), f"{vendor}: a padding row's result is NaN at batch {batch}"
    assert setup.runner.stats.replays == 5
    for (key, value), (eager_key, eager_value) in zip(setup.graph_cache, setup.eager_cache):
        for graph_tensor, eager_tensor in ((key, eager_key), (value, eager_value)):
            head_dim = setup.model.config.head_dim
            live = setup.model.ops.block_view(graph_tensor, head_dim)[1:]
            torch.testing.assert_close(live, setup.model.ops.block_view(eager_tensor, head_dim)[1:],
                                       atol=1e-5, rtol=1e-5)
