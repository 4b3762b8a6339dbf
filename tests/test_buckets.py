"""Bucket policies and capture lists."""

from __future__ import annotations

import pytest

from graphmode.buckets import (
    next_power_of_2,
    power_of_two_sizes,
    smallest_bucket,
    three_stage_size,
    three_stage_sizes,
)


@pytest.mark.parametrize("n, expected", [(0, 1), (1, 1), (2, 2), (3, 4), (17, 32), (256, 256), (257, 512)])
def test_next_power_of_2(n, expected):
    assert next_power_of_2(n) == expected


@pytest.mark.parametrize(
    "maximum, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (256, [1, 2, 4, 8, 16, 32, 64, 128, 256]),
        (300, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]),
        (1024, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]),
    ],
)
def test_power_of_two_sizes(maximum, expected):
    assert power_of_two_sizes(maximum) == expected


def test_three_stage_size_follows_its_three_stages():
    assert [three_stage_size(n) for n in (1, 3, 9, 16)] == [1, 4, 16, 16]
    assert [three_stage_size(n) for n in (17, 32, 33, 250, 256)] == [32, 32, 48, 256, 256]
    assert [three_stage_size(n) for n in (257, 511, 513)] == [512, 512, 768]


def test_three_stage_capture_list_for_256_has_20_graphs():
    sizes = three_stage_sizes(256)
    assert sizes == [1, 2, 4, 8, 16] + list(range(32, 257, 16))
    assert len(sizes) == 20


def test_three_stage_capture_list_is_capped_at_the_maximum():
    assert three_stage_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert three_stage_sizes(600)[-3:] == [256, 512, 600]


@pytest.mark.parametrize("maximum", [1, 7, 40, 256, 600])
def test_the_smallest_bucket_of_the_three_stage_list_is_the_three_stage_size(maximum):
    sizes = three_stage_sizes(maximum)
    for n in range(1, maximum + 1):
        assert smallest_bucket(n, sizes) == min(three_stage_size(n), maximum)


def test_smallest_bucket():
    assert smallest_bucket(3, (1, 2, 4, 8)) == 4
    assert smallest_bucket(8, (1, 2, 4, 8)) == 8
    assert smallest_bucket(9, (1, 2, 4, 8)) is None
