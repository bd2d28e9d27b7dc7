"""Process groups named by their shape, and when ranks may share compiles (one spawned rank with a gloo
group of one; what several ranks share is in test_compile_cache.py)."""

from __future__ import annotations


import workers_shared_compiles as workers
from distributed import run_ranks


def _run(check, tmp_path) -> None:
    run_ranks(check, 1, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})


def test_a_graph_names_its_groups_by_shape_and_still_runs(tmp_path):
    _run(workers.names_groups_by_shape, tmp_path)


def test_the_name_of_a_destroyed_group_goes_to_the_next_group_of_its_shape(tmp_path):
    _run(workers.renames_after_a_destroyed_group, tmp_path)


def test_ranks_do_not_share_compiles_where_a_compile_runs_collectives_or_bakes_the_rank_in(tmp_path):
    _run(workers.shares_nothing_under_overlap_scheduling, tmp_path)


def test_a_rank_compiles_a_graph_itself_when_another_holds_it_too_long(tmp_path):
    _run(workers.compiles_when_the_lock_is_held_too_long, tmp_path)


def test_ranks_compile_a_graph_side_by_side_once_the_cache_bypassed_it(tmp_path):
    _run(workers.compiles_side_by_side_once_bypassed, tmp_path)


def test_a_gathered_bucket_of_several_dtypes_gives_each_shard_back_in_its_dtype(tmp_path):
    _run(workers.unpacks_a_bucket_of_several_dtypes, tmp_path)
