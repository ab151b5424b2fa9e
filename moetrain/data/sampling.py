"""Random-access pseudo-random choices: document orders and mixture draws, computed per index.

A shuffled epoch is usually a permutation array of all documents: 8 bytes a document in
memory, and a pass over all of them before the first batch. Here the k-th document of an
epoch is computed from (seed, epoch, k) alone, by a keyed Feistel network on the smallest
even-bit domain that holds the documents, with cycle walking back into [0, n). Reading a
window of an epoch costs time and memory proportional to the window, whatever the size of
the dataset, and every process computes the same order without communicating.

The mixture of several datasets draws, for global sequence i, a dataset from
hash(seed, i): the same draw for a sequence whatever the layout, the micro-batching or the
point at which a run was resumed.
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): a good 64-bit hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keys(*parts: object) -> np.ndarray:
    """``_ROUNDS`` 64-bit keys from ``parts``, stable across platforms and Python versions."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    digest += hashlib.sha256(digest).digest()
    return np.frombuffer(digest[: 8 * _ROUNDS], dtype="<u8").astype(np.uint64)


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """A bijection of [0, 4**half): balanced Feistel rounds over two ``half``-bit halves."""
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix64(right ^ key) & mask)
    return (left << shift) | right


def permutation_slice(seed: int | None, epoch: int, n: int, start: int, count: int) -> np.ndarray:
    """Positions ``[start, start + count)`` of the order of ``n`` items in ``epoch``: int64.

    ``seed`` None is the identity (stored order). Otherwise a permutation of ``range(n)``
    drawn from (seed, epoch); ``permutation_slice(s, e, n, 0, n)`` is the whole of it.
    """
    stop = min(start + count, n)
    if start >= stop:
        return np.zeros(0, dtype=np.int64)
    idx = np.arange(start, stop, dtype=np.uint64)
    if seed is None or n == 1:
        return idx.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n, < 4n
    keys = _keys("moetrain-order", seed, epoch)
    out = _feistel(idx, keys, half)
    # Cycle walking: a value outside [0, n) is mapped again until it lands inside. Each
    # cycle of the bijection through an item < n returns to [0, n), so this terminates,
    # and the result is a bijection of [0, n) (fewer than 4 rounds of walking expected).
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = _feistel(out[outside], keys, half)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def uniform_slice(seed: int | str, start: int, count: int) -> np.ndarray:
    """Uniform floats in [0, 1) for indices ``[start, start + count)`` of a stream keyed by
    ``seed``: value i depends on (seed, i) alone."""
    key = _keys("moetrain-mix", seed)[0]
    idx = np.arange(start, start + count, dtype=np.uint64)
    bits = _mix64(_mix64(idx ^ key) + key)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def weighted_choice(
    seed: int | str, weights: np.ndarray | list[float], start: int, count: int
) -> np.ndarray:
    """Index drawn with probability ``weights[k] / sum(weights)`` for each position of
    ``[start, start + count)``; position i's draw depends on (seed, weights, i) alone."""
    w = np.asarray(weights, dtype=np.float64)
    edges = np.cumsum(w / w.sum())
    edges[-1] = 1.0  # rounding must not leave a sliver above the last edge
    picks = np.searchsorted(edges, uniform_slice(seed, start, count), side="right")
    return np.minimum(picks, len(w) - 1).astype(np.int64)
