"""The training memory model: fitted from measured peaks, with a margin, picks the largest micro-batch."""

import random

import pytest

from computron.colocate.memmodel import MemoryModel

MB = 1 << 20


def test_fit_recovers_a_noisy_affine_peak_and_never_under_predicts_what_it_saw():
    rng = random.Random(0)
    mm = MemoryModel(prior_fixed=100 * MB, prior_per_sample=50 * MB)  # a poor prior
    true = lambda m: 700 * MB + 37 * MB * m
    for m in [1, 2, 4, 8, 8, 3, 6]:
        mm.record(m, int(true(m) + rng.uniform(-2, 2) * MB))
    fixed, per = mm.coefficients()
    assert abs(fixed - 700 * MB) < 5 * MB and abs(per - 37 * MB) < 1 * MB
    for m, peak in mm.points.items():
        assert mm.predict(m) >= peak
    assert mm.predict(5) <= true(5) * 1.06 + 4 * MB  # the margin stays small


def test_largest_micro_batch_that_fits():
    mm = MemoryModel(prior_fixed=0, prior_per_sample=0, rel_margin=0.0)
    mm.record(1, 110)
    mm.record(3, 130)  # peak = 100 + 10 m
    assert mm.largest(160, most=64) == 6
    assert mm.largest(159, most=64) == 5
    assert mm.largest(160, most=4) == 4
    assert mm.largest(105, most=64) == 0


def test_prior_until_two_sizes_measured_then_its_slope_through_one_point():
    mm = MemoryModel(prior_fixed=1000, prior_per_sample=100, rel_margin=0.0)
    assert mm.predict(2) == 1200
    mm.record(2, 1500)
    assert mm.coefficients() == (1300, 100) and mm.predict(4) == 1700


def test_two_inflated_peaks_do_not_make_every_size_too_large():
    """The stall a hybrid run met (GPT-2-medium, 14 GiB static limit): two sizes' largest peaks both
    15.31 GiB fitted a slope of 0, so one sample looked like 16.9 GiB and the job paused for good. With
    the slope floored at half the prior's a small micro-batch fits, and once it is measured the model
    follows the measurement (predicting at least every peak seen)."""
    gib = 2**30
    mm = MemoryModel(prior_fixed=int(6.61 * gib), prior_per_sample=int(0.567 * gib))
    mm.record(16, int(15.31 * gib))
    mm.record(11, int(15.31 * gib))
    m = mm.largest(14 * gib, most=16)
    assert m >= 1
    assert MemoryModel(0, 0, points=dict(mm.points)).largest(14 * gib, most=16) == 0  # no prior: no floor
    mm.record(m, int(7.5 * gib))  # what that size really takes
    for size, peak in mm.points.items():
        assert mm.predict(size) >= peak
    assert mm.largest(14 * gib, most=16) >= m


def test_the_margin_is_on_the_activations_so_a_measured_size_keeps_fitting_its_own_limit():
    """The hybrid bench's GPT-2-medium job measured 15.7 GiB at its micro-batch of 16 under a limit of
    16.41 GiB. A 5% margin on the whole peak predicted 16.49 GiB and cut it to 11 for the whole run;
    on the activations (9 GiB of it) the margin is 0.45 GiB and 16 still fits, while a limit under the
    measured peak still shrinks it."""
    gib = 2**30
    mm = MemoryModel(prior_fixed=int(6.61 * gib), prior_per_sample=int(0.567 * gib))
    mm.record(16, int(15.7 * gib))
    assert mm.predict(16) >= int(15.7 * gib)
    assert mm.largest(int(16.41 * gib), most=16) == 16
    assert mm.largest(int(15.6 * gib), most=16) < 16
    assert mm.predict(8) - (15.7 - 8 * 0.567) * gib > 0.2 * gib  # smaller sizes keep a margin too


def test_a_size_forgets_a_passing_peak_once_measured_again_at_its_steady_one():
    """Two steps right after a handover on an H200 (GPT-2-medium, micro-batch 1) peaked 5.3 GiB over
    the same size's steady 6.8 GiB. Kept as the size's largest for good, they held the job at one
    sample a micro-batch for a whole run and then paused it under a 13 GiB split it had trained in.
    The point is the largest of the size's last ``window`` peaks: measured again that many times, the
    model predicts from the steady peaks."""
    gib = 2**30
    mm = MemoryModel(prior_fixed=int(6.61 * gib), prior_per_sample=int(0.567 * gib), window=8)
    steady = lambda m: int((6.4 + 0.53 * m) * gib)
    for _ in range(20):
        mm.record(16, steady(16))
    for _ in range(10):
        mm.record(1, steady(1) + int(5.3 * gib))
    assert mm.largest(13 * gib, most=16) <= 3  # what the passing peak leaves the job
    for _ in range(7):
        mm.record(1, steady(1))
    assert mm.points[1] == steady(1) + int(5.3 * gib)  # still among the last 8
    mm.record(1, steady(1))
    assert mm.points[1] == steady(1)
    assert mm.largest(13 * gib, most=16) == 11  # (13 - 6.4) / (0.53 * 1.05) = 11.9 samples with the margin
    for m, peak in mm.points.items():
        assert mm.predict(m) >= peak


def test_a_point_the_model_was_made_with_counts_among_its_size_peaks():
    mm = MemoryModel(0, 0, window=2, points={4: 500})
    mm.record(4, 300)
    assert mm.points[4] == 500  # 500 is still among the last two
    mm.record(4, 300)
    assert mm.points[4] == 300
    with pytest.raises(ValueError, match="window is the peaks a size keeps, at least 1; got 0"):
        MemoryModel(0, 0, window=0)
