"""Per-index orders and draws: permutations computed a window at a time, seeded mixture draws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moetrain.data.sampling import permutation_slice, uniform_slice, weighted_choice


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 255, 1000, 4097])
def test_every_epoch_order_is_a_permutation_and_windows_agree(n):
    for seed, epoch in [(0, 0), (0, 1), (7, 0)]:
        order = permutation_slice(seed, epoch, n, 0, n)
        assert order.dtype == np.int64
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
        # Any window of the order is computed on its own, without the rest.
        for start, count in [(0, 1), (n // 3, 5), (n - 1, 10), (n, 4)]:
            np.testing.assert_array_equal(
                permutation_slice(seed, epoch, n, start, count), order[start : start + count]
            )


def test_orders_depend_on_seed_and_epoch_and_none_is_stored_order():
    n = 1000
    orders = {(s, e): permutation_slice(s, e, n, 0, n) for s in (0, 1) for e in (0, 1)}
    keys = list(orders)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert (orders[a] != orders[b]).mean() > 0.9, (a, b)
    np.testing.assert_array_equal(permutation_slice(None, 5, n, 10, 20), np.arange(10, 30))
    assert np.array_equal(permutation_slice(3, 2, n, 0, n), permutation_slice(3, 2, n, 0, n))


def test_order_is_shuffled_not_merely_rotated():
    # Over many seeds, where item 0 lands is spread evenly over the 8 positions.
    where = [int(np.flatnonzero(permutation_slice(s, 0, 8, 0, 8) == 0)[0]) for s in range(4000)]
    counts = np.bincount(where, minlength=8)
    expected = 4000 / 8
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30, counts  # 7 degrees of freedom: p < 1e-4 would be ~29


def test_a_window_of_a_huge_epoch_costs_only_the_window():
    n = 10**12  # no permutation array of this size could exist
    window = permutation_slice(1, 0, n, 123_456_789, 1000)
    assert len(set(window.tolist())) == 1000 and window.min() >= 0 and window.max() < n


def test_uniform_and_weighted_draws():
    u = uniform_slice(5, 0, 100_000)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    np.testing.assert_array_equal(uniform_slice(5, 1000, 10), u[1000:1010])
    weights = [0.6, 0.3, 0.1]
    n = 200_000
    picks = weighted_choice(0, weights, 0, n)
    for k, w in enumerate(weights):
        sigma = math.sqrt(n * w * (1 - w))
        assert abs((picks == k).sum() - n * w) < 5 * sigma
    np.testing.assert_array_equal(weighted_choice(0, weights, 500, 100), picks[500:600])
    assert not np.array_equal(weighted_choice(1, weights, 0, 1000), picks[:1000])
    # Unnormalised weights mean the same thing.
    np.testing.assert_array_equal(weighted_choice(0, [6, 3, 1], 0, 1000), picks[:1000])
