"""Small-sample statistics for multi-seed comparisons (``moetrain ablate`` with ``seeds:``).

- ``mean_interval``: the mean of n runs, their sample standard deviation (n - 1) and the
  two-sided confidence interval mean +- t_{1-a/2, n-1} * std / sqrt(n) (Student's t: the
  seeds are a small sample of a distribution whose spread is estimated from them).
- ``difference_interval``: a variant's difference from the baseline. Paired by seed when
  both ran the same seeds (each seed's difference, then ``mean_interval`` of those: the
  seed's share of the noise -- initialisation, router jitter -- cancels); otherwise
  Welch's unpaired interval with the Welch-Satterthwaite degrees of freedom.

The t quantile is computed here (regularised incomplete beta by continued fraction, then
bisection), so that no statistics package is needed; ``tests/tools/test_stats.py`` checks it
against tabulated values and the closed forms of 1 and 2 degrees of freedom, and both
intervals against hand computations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NAN = float("nan")


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` > 0 degrees of freedom."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """A mean with its spread and two-sided confidence interval (``NAN`` where n < 2)."""

    n: int
    mean: float
    std: float
    lo: float
    hi: float
    kind: str = ""
    """For differences: "paired" (by seed) or "unpaired" (Welch)."""

    @property
    def within_noise(self) -> bool:
        """The interval spans zero (or cannot be computed): no difference shown."""
        return not (self.lo > 0 or self.hi < 0)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean, sample std and the t interval of ``values`` (finite values only)."""
    xs = [float(v) for v in values if math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(0, NAN, NAN, NAN, NAN)
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(1, mean, NAN, NAN, NAN)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return Interval(n, mean, std, mean - half, mean + half)


def difference_interval(
    variant: dict[int, float], baseline: dict[int, float], confidence: float = 0.95
) -> Interval:
    """The variant's mean minus the baseline's, from values by seed. Paired over the seeds
    both have when there are at least two; else Welch's unpaired interval."""
    def finite(d: dict[int, float]) -> dict[int, float]:
        return {s: float(v) for s, v in d.items() if math.isfinite(float(v))}

    a, b = finite(variant), finite(baseline)
    common = sorted(set(a) & set(b))
    if len(common) >= 2:
        d = mean_interval([a[s] - b[s] for s in common], confidence)
        return Interval(d.n, d.mean, d.std, d.lo, d.hi, "paired")
    ia, ib = mean_interval(list(a.values())), mean_interval(list(b.values()))
    mean = ia.mean - ib.mean
    if ia.n < 2 or ib.n < 2:
        return Interval(min(ia.n, ib.n), mean, NAN, NAN, NAN, "unpaired")
    va, vb = ia.std**2 / ia.n, ib.std**2 / ib.n
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(min(ia.n, ib.n), mean, 0.0, mean, mean, "unpaired")
    df = (va + vb) ** 2 / (va**2 / (ia.n - 1) + vb**2 / (ib.n - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    return Interval(min(ia.n, ib.n), mean, se, mean - half, mean + half, "unpaired")
