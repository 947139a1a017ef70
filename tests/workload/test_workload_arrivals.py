"""Arrival processes match their requested rate and CV; skew shares match the exponent.

Tolerances are 4 standard errors. For Gamma(shape k) inter-arrivals with coefficient of
variation c (skewness 2c, excess kurtosis 6c²), the delta method gives
Var(log mean) ≈ c²/n and Var(log CV) ≈ (c² + (6c²+2)/4 - 2c²)/n = (c²/2 + 1/2)/n.
"""

import math

import numpy as np
import pytest

from computron.workload import Bursts, Gamma, Poisson, make_workload, model_rates, power_law_weights

N = 20_000


def gaps(times):
    return np.diff(np.concatenate([[0.0], times]))


def check_rate_cv(g, rate, cv):
    n = len(g)
    mean, sd = g.mean(), g.std(ddof=1)
    se_log_mean = cv / math.sqrt(n)
    assert abs(math.log(mean * rate)) < 4 * se_log_mean + 1e-12, (mean, 1 / rate)
    se_log_cv = math.sqrt((cv**2 / 2 + 0.5) / n)
    assert abs(math.log((sd / mean) / cv)) < 4 * se_log_cv, (sd / mean, cv)


@pytest.mark.parametrize("cv", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("rate", [0.5, 20.0])
def test_gamma_rate_and_cv(rate, cv):
    t = Gamma(rate, cv).times(N / rate, rng=123)
    assert abs(len(t) - N) < 4 * cv * math.sqrt(N) + 2  # renewal count: var ≈ n·cv²
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < N / rate
    check_rate_cv(gaps(t), rate, cv)


def test_poisson_rate_and_cv_is_one():
    rate = 3.0
    t = Poisson(rate).times(N / rate, rng=7)
    check_rate_cv(gaps(t), rate, 1.0)


def test_gamma_cv_zero_is_evenly_spaced():
    np.testing.assert_allclose(Gamma(4.0, 0.0, start="arrival").times(1.0), [0.25, 0.5, 0.75])
    phases = []
    for seed in range(200):  # stationary: the same spacing from a uniform phase in [0, 0.25)
        t = Gamma(4.0, 0.0).times(1.0, seed)
        assert len(t) == 4 and t[-1] < 1.0, t
        np.testing.assert_allclose(np.diff(t), 0.25)
        phases.append(t[0])
    assert 0 <= min(phases) < 0.01 and 0.24 < max(phases) < 0.25
    assert abs(np.mean(phases) - 0.125) < 0.02  # 4 standard errors


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_is_stationary_from_zero_and_opens_with_a_burst_started_at_an_arrival(cv):
    """Seen from a random instant, a window at 0 gets its share of the rate, and the first arrival
    comes on average (1 + cv^2) / (2 rate) after it; started at an arrival, a bursty stream puts
    several times its share into the first half gap (the burst every model's stream opened with)."""
    rate, window, n = 2.0, 0.25, 8000
    counts = np.array([len(Gamma(rate, cv).times(window, seed)) for seed in range(n)])
    assert abs(counts.mean() - rate * window) < 4 * counts.std() / math.sqrt(n) + 1e-9, counts.mean()
    firsts = np.array([Gamma(rate, cv).times(1000.0, seed)[0] for seed in range(n)])
    assert abs(firsts.mean() - (1 + cv**2) / (2 * rate)) < 4 * firsts.std() / math.sqrt(n), firsts.mean()
    old = np.array([len(Gamma(rate, cv, start="arrival").times(window, seed)) for seed in range(n)])
    if cv > 1:
        assert old.mean() > 2.5 * rate * window, old.mean()  # 1.49 and 4.42 arrivals at cv 2 and 4, against 0.5
    else:
        assert old.mean() < 0.5 * rate * window, old.mean()  # regular: the first arrival comes about a gap after 0
    with pytest.raises(ValueError, match="start must be one of"):
        Gamma(rate, cv, start="burst")


def test_times_are_in_range_and_seeded():
    for proc in (Poisson(5.0), Gamma(5.0, 2.0), Bursts(10.0, 1.0, 1.0)):
        a, b = proc.times(100.0, rng=1), proc.times(100.0, rng=np.random.default_rng(1))
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, proc.times(100.0, rng=2))
        assert a.min() >= 0 and a.max() < 100.0 and np.all(np.diff(a) >= 0)
    assert len(Poisson(5.0).times(0.0, 1)) == 0 and len(Poisson(0.0).times(10.0, 1)) == 0


def test_bursts_on_rate_and_silence_when_off():
    proc = Bursts(on_rate=50.0, mean_on=2.0, mean_off=6.0)
    duration = 4000.0
    times, periods = proc.times_and_periods(duration, rng=11)
    on_time = float((periods[:, 1] - periods[:, 0]).sum())
    inside = np.zeros(len(times), bool)
    for s, e in periods:
        inside |= (times >= s) & (times < e)
    assert inside.all()  # no arrivals during off periods
    # Given the on periods, the count is Poisson(on_rate * on_time).
    expected = proc.on_rate * on_time
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)
    # On-fraction ≈ mean_on/(mean_on+mean_off) = 0.25 (~1000 cycles of ~8 s; generous bound).
    assert abs(on_time / duration - 0.25) < 0.05
    # Bursty: CV of inter-arrivals well above Poisson's 1.
    g = gaps(times)
    assert g.std() / g.mean() > 1.5


def test_bursts_with_mean_rate():
    b = Bursts.with_mean_rate(2.0, mean_on=1.0, mean_off=3.0)
    assert b.on_rate == pytest.approx(8.0) and b.rate == pytest.approx(2.0)


@pytest.mark.parametrize("skew", [0.0, 1.0, 2.0])
def test_skew_shares_match_exponent(skew):
    models = [f"m{i}" for i in range(5)]
    w = 1.0 / np.arange(1, 6) ** skew
    w /= w.sum()
    np.testing.assert_allclose(power_law_weights(5, skew), w)
    r = model_rates(models, 10.0, skew=skew)
    np.testing.assert_allclose([r[m] for m in models], 10.0 * w)
    trace = make_workload(models, rate=20.0, duration=2000.0, skew=skew, process="poisson", seed=3)
    counts = trace.counts()
    n = len(trace)
    for m, p in zip(models, w):
        share = counts.get(m, 0) / n
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (m, share, p)


def test_explicit_rates():
    assert model_rates(["a", "b"], rates=[1.5, 0.0]) == {"a": 1.5, "b": 0.0}
    with pytest.raises(ValueError, match="2 rates for 3 models"):
        model_rates(["a", "b", "c"], rates=[1.0, 2.0])
    with pytest.raises(ValueError):
        model_rates(["a", "a"], 1.0)
    t = make_workload(["a", "b"], rate=None, rates=[5.0, 0.0], duration=100.0, seed=1)
    assert set(t.counts()) == {"a"}
