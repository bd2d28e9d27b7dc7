"""Planned once per job: rank 0 runs the policy and sends the plan; the other ranks install it, and a job
that finds the plan in ``cache_dir`` runs the policy on no rank. A rank 0 whose planning fails sends its
error instead, so every rank raises at once."""

from __future__ import annotations

from distributed import run_ranks
from parity import assert_ranks_train_like_one_process, assert_parity_job_trains_like_one_process
from workers_plan_once import failures, pipeline_job, tp_job


def test_rank_0_plans_alone_the_others_train_on_its_plan_and_a_new_job_reads_it_from_cache_dir(tmp_path):
    env = {"DYNSHARD_CACHE_DIR": str(tmp_path)}
    first = run_ranks(tp_job, 2, 3, env=env, timeout=240)
    assert [r["policy_calls"] for r in first] == [1, 0]
    assert_parity_job_trains_like_one_process(first)
    assert [name for name, _ in first[1]["pass_timings"][0]].count("receive_plan") == 1
    assert "receive_plan" not in dict(first[0]["pass_timings"][0])
    assert len(list(tmp_path.glob("plan-*.json"))) == 1

    again = run_ranks(tp_job, 2, 2, env=env, timeout=240)     # a restart: the plan is in cache_dir
    assert [r["policy_calls"] for r in again] == [0, 0]
    assert_parity_job_trains_like_one_process(again)
    assert again[0]["parallel_dims"] == first[0]["parallel_dims"]


def test_a_failing_planner_fails_every_rank_at_once_and_the_ranks_stay_in_step():
    job = run_ranks(failures, 2, timeout=120)
    raised = [r["policy_raises"] for r in job]
    assert raised[0]["error"] == ("PlanError", "no plan for this graph (raised on rank 0)")
    kind, message = raised[1]["error"]
    assert kind == "PlanningFailedError", message
    assert "rank 0 failed while planning" in message and "PlanError: no plan for this graph (raised on rank 0)" \
        in message, message
    assert all(r["seconds"] < 20 for r in raised), raised

    # rank 1 fails before the policy pass: it raises its own error, rank 0 compiles
    lowering = [r["lowering_fails_on_rank_1"] for r in job]
    assert lowering[0]["error"] is None
    assert lowering[1]["error"] == ("RuntimeError", "lowering broke on rank 1")

    after = [r["after"] for r in job]
    assert [r["error"] for r in after] == [None, None]
    assert after[0]["placements"] == after[1]["placements"]
    assert "Shard(dim=0)" in after[0]["placements"]["blocks.0.0.weight"], after[0]["placements"]

    sequence_parallel = [r["sequence_parallel"] for r in job]      # rank 1 compiled rank 0's activation placements
    assert [r["error"] for r in sequence_parallel] == [None, None]
    assert "receive_plan" in sequence_parallel[1]["pass_timings"]
    kinds = [{kind for _, kind, _, _ in r["collectives"]} for r in sequence_parallel]
    assert {"all_gather", "reduce_scatter"} <= kinds[0], kinds[0]
    assert sequence_parallel[0]["collectives"] == sequence_parallel[1]["collectives"]


def test_rank_0_cuts_the_pipeline_stages_the_others_install_its_cut_and_a_new_job_reads_it(tmp_path):
    env = {"DYNSHARD_CACHE_DIR": str(tmp_path)}
    first = run_ranks(pipeline_job, 2, env=env, timeout=240)
    assert [r["cuts_made"] for r in first] == [1, 0]          # FLOPs measured on rank 0 only
    assert "receive_plan" in first[1]["pass_timings"][0] and "receive_plan" not in first[0]["pass_timings"][0]
    assert_ranks_train_like_one_process(first)
    assert first[0]["modules"] == first[1]["modules"]
    assert len(list(tmp_path.glob("plan-*.json"))) == 1

    again = run_ranks(pipeline_job, 2, env=env, timeout=240)
    assert [r["cuts_made"] for r in again] == [0, 0]
    assert_ranks_train_like_one_process(again)
    assert again[0]["modules"] == first[0]["modules"]
