"""The multi-rank harness itself: a job whose ranks do not all run fails the test that started it."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers import fail_on_rank_one


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 could not start"):
        run_ranks(fail_on_rank_one, 2)
