"""One minute's worth: a burst up to the limit, a steady refill, reservations settled."""

from __future__ import annotations

import pytest

from epd_trio._core.token_bucket import TokenBucket, retry_after


def test_a_burst_up_to_the_limit_passes_then_it_refills_steadily() -> None:
    bucket = TokenBucket.full(60, now=0.0)  # 1 a second
    assert all(bucket.take(1, now=0.0) == 0.0 for _ in range(60))
    assert bucket.take(1, now=0.0) == pytest.approx(1.0)
    assert bucket.take(1, now=0.5) == pytest.approx(0.5)  # nothing taken on a refusal
    assert bucket.take(1, now=1.0) == 0.0
    assert bucket.take(2, now=3.0) == 0.0


def test_settle_gives_back_what_was_not_used_or_takes_the_excess() -> None:
    bucket = TokenBucket.full(600, now=0.0)
    assert bucket.take(500, now=0.0) == 0.0
    bucket.settle(reserved=500, used=100, now=0.0)
    assert bucket.level == 500
    bucket.settle(reserved=0, used=900, now=0.0)
    assert bucket.level == -400  # a debt: paid by the refill before anyone passes
    assert bucket.take(1, now=0.0) == pytest.approx(401 / 10)


def test_more_than_the_whole_bucket_passes_only_when_it_is_full() -> None:
    bucket = TokenBucket.full(60, now=0.0)
    assert bucket.take(100, now=0.0) == 0.0
    assert bucket.level == -40
    assert bucket.take(100, now=0.0) == pytest.approx(100.0)  # (60 - -40) / 1 per second


@pytest.mark.parametrize(("seconds", "header"), [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2),
                                                 (59.5, 60)])
def test_retry_after_is_whole_seconds_at_least_one(seconds: float, header: int) -> None:
    assert retry_after(seconds) == header
