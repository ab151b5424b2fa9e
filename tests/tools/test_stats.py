"""The small-sample statistics behind every sweep table (``moetrain.ablation.stats``): the t
quantile against printed tables and the closed forms of 1 and 2 degrees of freedom, the
paired interval and Welch's unpaired interval against hand computations.

scipy is not a dependency (the module computes its quantiles itself so that none is
needed), so the references here are a t table's three decimals and arithmetic done by
hand, each case chosen so that the numbers can be checked on paper.
"""

from __future__ import annotations

import math

import pytest

from moetrain.ablation import stats

T_TABLE = {
    0.975: {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042},
    0.95: {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 10: 1.812, 30: 1.697},
}
"""Student's t quantiles t_{p, df} as printed in statistics tables (three decimals): the
two-sided 95% and 90% intervals' factors."""
TABLE_TOL = 5e-4
"""A printed quantile is the true one rounded to three decimals."""


@pytest.mark.parametrize("p", sorted(T_TABLE))
def test_t_quantile_matches_the_printed_table(p: float) -> None:
    for df, want in T_TABLE[p].items():
        got = stats.t_quantile(p, df)
        assert abs(got - want) <= TABLE_TOL, (p, df, got, want)
        assert stats.t_quantile(1 - p, df) == pytest.approx(-got, abs=1e-12)
        assert stats.t_cdf(got, df) == pytest.approx(p, abs=1e-12)


def test_t_quantile_matches_the_closed_forms() -> None:
    """df 1 is Cauchy's distribution, t = tan(pi (p - 1/2)); df 2 has t = (2p - 1) /
    sqrt(2 p (1 - p))."""
    for p in (0.6, 0.9, 0.95, 0.975, 0.995):
        assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        want = (2 * p - 1) / math.sqrt(2 * p * (1 - p))
        assert stats.t_quantile(p, 2) == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="0 < p < 1 and df > 0"):
        stats.t_quantile(1.0, 3)


def test_paired_interval_by_hand() -> None:
    """Seeds 0-2 in both: each seed's difference (1, 2, 0), mean 1, sample std 1, half
    width t_{0.975, 2} / sqrt(3)."""
    d = stats.difference_interval({0: 5.0, 1: 7.0, 2: 6.0}, {0: 4.0, 1: 5.0, 2: 6.0})
    assert (d.kind, d.n, d.mean, d.std) == ("paired", 3, 1.0, 1.0)
    half = T_TABLE[0.975][2] / math.sqrt(3)
    assert abs(d.lo - (1 - half)) <= TABLE_TOL and abs(d.hi - (1 + half)) <= TABLE_TOL, d


WELCH_A = {0: 9.0, 1: 11.0}
WELCH_B = {10: 3.0, 11: 7.0, 12: 7.0, 13: 7.0}
"""No seed in common: Welch's unpaired interval. A: mean 10, s^2 = (1 + 1) / 1 = 2, s^2 / n
= 1; B: mean 6, s^2 = (9 + 1 + 1 + 1) / 3 = 4, s^2 / n = 1. Difference 4, standard error
sqrt(1 + 1) = sqrt(2), Welch-Satterthwaite degrees of freedom (1 + 1)^2 / (1^2 / 1 + 1^2 / 3)
= 3 (the pooled n_a + n_b - 2 would be 4, the conservative min(n) - 1 would be 1)."""


def welch_problems(interval=None) -> list[str]:
    """What ``difference_interval`` (or ``interval``) gets wrong of ``WELCH_A`` - ``WELCH_B``
    at 95% and 90%, against the hand computation above and the table's t_{p, 3}."""
    interval = interval or stats.difference_interval
    out = []
    se = math.sqrt(2.0)
    for confidence, p in ((0.95, 0.975), (0.9, 0.95)):
        d = interval(WELCH_A, WELCH_B, confidence)
        if (d.kind, d.n, d.mean) != ("unpaired", 2, 4.0) or d.std != pytest.approx(se):
            out.append(f"{confidence:.0%}: {d}, want unpaired, n 2, mean 4, standard error {se}")
        t = T_TABLE[p][3]
        for end, got, want in (("lo", d.lo, 4.0 - t * se), ("hi", d.hi, 4.0 + t * se)):
            if abs(got - want) > TABLE_TOL * se:
                out.append(f"{confidence:.0%} {end} {got:.4f}, by hand {want:.4f} (t_{p}, 3 = "
                           f"{t}; its factor {abs(got - 4.0) / se:.3f})")  # fmt: skip
    return out


def test_welch_interval_by_hand() -> None:
    assert welch_problems() == []


def test_welch_interval_with_fractional_degrees_of_freedom() -> None:
    """A: 1, 2, 4 (mean 7/3, s^2 = 7/3); B: 0, 5, 10, 3 (mean 4.5, s^2 = 17.67): the
    Welch-Satterthwaite df is not an integer, so the factor lies strictly between the table's
    at the df either side."""
    a, b = [1.0, 2.0, 4.0], [0.0, 5.0, 10.0, 3.0]
    va = sum((x - sum(a) / 3) ** 2 for x in a) / 2 / 3
    vb = sum((x - sum(b) / 4) ** 2 for x in b) / 3 / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert 3 < df < 4, df
    d = stats.difference_interval(dict(enumerate(a)), {10 + i: x for i, x in enumerate(b)})
    assert d.kind == "unpaired" and d.mean == pytest.approx(sum(a) / 3 - sum(b) / 4)
    assert d.std == pytest.approx(math.sqrt(va + vb))
    factor = (d.hi - d.mean) / d.std
    assert T_TABLE[0.975][4] < factor < T_TABLE[0.975][3], (df, factor)
    assert d.mean - d.lo == pytest.approx(d.hi - d.mean)


def test_degenerate_intervals() -> None:
    """One value a side: no spread, no interval; identical values: a zero-width one."""
    one = stats.difference_interval({0: 1.0}, {1: 2.0})
    assert one.kind == "unpaired" and one.mean == -1.0
    assert all(math.isnan(x) for x in (one.std, one.lo, one.hi))
    flat = stats.difference_interval({0: 2.0, 1: 2.0}, {2: 1.0, 3: 1.0})
    assert (flat.mean, flat.std, flat.lo, flat.hi) == (1.0, 0.0, 1.0, 1.0)
    assert stats.mean_interval([3.0]).n == 1 and math.isnan(stats.mean_interval([3.0]).lo)


def test_pooled_degrees_of_freedom_are_caught(monkeypatch) -> None:
    """tests/faults.py ``welch_pooled_df``: n_a + n_b - 2 = 4 degrees of freedom instead of
    Welch-Satterthwaite's 3 -- a narrower interval than the data support: the interval's
    factors are the table's t at df 4 (2.776, 2.132)."""
    from faults import plant

    plant("welch_pooled_df", monkeypatch.setattr)
    assert welch_problems() == [
        "95% lo 0.0735, by hand -0.5000 (t_0.975, 3 = 3.182; its factor 2.776)",
        "95% hi 7.9265, by hand 8.5000 (t_0.975, 3 = 3.182; its factor 2.776)",
        "90% lo 0.9851, by hand 0.6724 (t_0.95, 3 = 2.353; its factor 2.132)",
        "90% hi 7.0149, by hand 7.3276 (t_0.95, 3 = 2.353; its factor 2.132)",
    ]
