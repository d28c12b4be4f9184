"""E-Divisive change points on literal series with a known answer (Otava style)."""

from analytics.changepoints import change_points


def indexes(series, **kw):
    return [cp.index for cp in change_points(series, **kw)]


def test_one_step():
    assert indexes([1.0] * 10 + [2.0] * 10) == [10]


def test_two_steps():
    series = [160.0, 161.0, 159.5, 160.5, 160.0, 159.0, 161.0, 160.0, 160.5, 159.5] + [
        264.0, 263.0, 265.0, 264.5, 263.5, 264.0, 265.5, 263.0, 264.0, 264.5] + [
        160.5, 159.5, 160.0, 161.0, 160.0, 159.0, 160.5, 160.0, 161.0, 159.5]
    assert indexes(series) == [10, 20]


def test_no_change_in_a_flat_or_noisy_series():
    assert indexes([5.0] * 20) == []
    noisy = [100.2, 99.8, 100.1, 99.9, 100.3, 99.7, 100.0, 100.2, 99.9, 100.1, 99.8, 100.0, 100.3, 99.6]
    assert indexes(noisy) == []


def test_minimum_segment_length_drops_a_short_blip():
    series = [1.0] * 10 + [3.0] * 4 + [1.0] * 10
    assert indexes(series, min_segment=3, max_pvalue=0.01) == [10, 14]
    assert indexes(series, min_segment=5, max_pvalue=0.01) == []


def test_a_change_within_the_noise_does_not_count():
    # a 0.5% step in a series that moves by ~1% day to day: real, but not beyond the noise
    series = [100.0, 101.0, 99.0, 100.5, 99.5, 101.0, 99.0, 100.0, 100.5, 99.5] + [
        100.5, 101.5, 99.5, 101.0, 100.0, 101.5, 99.5, 100.5, 101.0, 100.0]
    assert indexes(series) == []
    assert indexes([1.0] * 10 + [1.01] * 10, min_magnitude=0.03) == []
    assert indexes([1.0] * 10 + [1.05] * 10, min_magnitude=0.03) == [10]


def test_the_change_is_measured():
    (cp,) = change_points([160.0] * 8 + [264.0] * 8)
    assert cp.mean_before == 160.0 and cp.mean_after == 264.0
    assert round(cp.rel_change, 3) == 0.65
