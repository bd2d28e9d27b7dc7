"""A job's state lives as long as its default process group: a new group (a restart) starts afresh."""

from __future__ import annotations

from distributed import run_ranks
from workers_job import job_lifetimes


def test_a_job_begins_before_its_group_and_ends_with_it_or_by_hand():
    (seen,) = run_ranks(job_lifetimes, 1, timeout=120)
    assert seen == {"stable_without_group": True, "first_group_keeps_the_job": True, "new_group_new_job": True,
                    "ended_parts_released": True, "numbers": [0, 1, 2], "new_job_same_group": True}
