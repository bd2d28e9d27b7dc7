"""Surviving a dead process: a save killed midway leaves the previous checkpoint the latest and loadable,
and a real torchrun job whose rank dies is restarted, resumes from its newest complete checkpoint and ends
bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import dynshard
from distributed import run_ranks
from parity import assert_tensors_equal
from workers_restart import KILL_POINTS, resume_from_latest, train_then_die_saving

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_with_restarts.py")


def test_a_killed_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path):
    roots = {}
    for where in KILL_POINTS:
        root = str(tmp_path / where)
        with pytest.raises(AssertionError, match="a rank (died|failed)"):
            run_ranks(train_then_die_saving, 2, root, where, timeout=120)
        names = sorted(os.listdir(root))
        # what the killed save left on disk
        if where == "before_marker":
            assert names == ["step2", "step3"], names
            assert ".metadata" in os.listdir(os.path.join(root, "step3"))
            assert "COMPLETE" not in os.listdir(os.path.join(root, "step3"))
        else:
            assert len(names) == 2 and names[0] == "step2" and names[1].startswith("step3.tmp-"), names
            written = sorted(os.listdir(os.path.join(root, names[1])))
            if where == "dcp_write":
                assert "__1_0.distcp" in written and ".metadata" not in written, written
            else:
                assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(written), written
        assert dynshard.checkpoint.latest(root) == os.path.join(root, "step2"), where
        roots[where] = root

    # a new job resumes from step2 in each case (before its first step, then into its pieces), continues
    # exactly as the killed job did, and saves over the leftovers
    ranks = run_ranks(resume_from_latest, 2, list(roots.values()), timeout=180)
    for rank, results in enumerate(ranks):
        for where, root in roots.items():
            r, expected = results[root], torch.load(f"{root}.expected.pt", weights_only=False)
            what = f"rank {rank} {where}"
            assert r["latest"] == os.path.join(root, "step2") and r["extra"] == {"step": 2}, what
            assert_tensors_equal(r["loaded"]["params"], expected["at_save"]["params"], f"{what} loaded")
            assert_tensors_equal(r["loaded"]["momentum"], expected["at_save"]["momentum"], f"{what} loaded momentum")
            assert_tensors_equal(r["after_step"]["params"], expected["after_step"]["params"], f"{what} resumed")
            assert_tensors_equal(r["after_step"]["momentum"], expected["after_step"]["momentum"], f"{what} momentum")
            assert r["latest_after_save"] == os.path.join(root, "step3"), what
            # this rank's RNG state comes back, also when loaded before the process group exists
            assert torch.equal(r["rng"], torch.load(f"{root}.rng{rank}.pt")), what
    first = [r[roots["dcp_write"]] for r in ranks]
    assert not first[0]["group_before_load"] and not first[1]["group_before_load"]
    assert not torch.equal(first[0]["rng"], first[1]["rng"])
    assert all(r[roots["before_marker"]]["group_before_load"] for r in ranks)     # loaded into pieces


# --------------------------------------------------------------------------------------------------------
# a real torchrun job with --max-restarts, rank 1 killed at step 5 of 8

STEPS, SAVE_EVERY, KILL_STEP = 8, 3, 5
TINY = ["--compiler", "aot_eager", "--policy", "tp", "--plan", "2", "--optimizer", "adamw", "--lr-noise", "0.5",
        "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--batch", "4",
        "--vocab", "64", "--seq", "16", "--d-model", "32", "--heads", "4", "--layers", "1"]


def _torchrun(workdir: str, *extra: str) -> subprocess.Popen:
    os.makedirs(workdir)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.1", SCRIPT,
               "--ckpt-dir", os.path.join(workdir, "ckpt"), "--out", os.path.join(workdir, "final.pt"),
               *TINY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DYNSHARD_EXAMPLE_KILL_AT", None)
    log = open(os.path.join(workdir, "log"), "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)      # its own process group: ended whole on a time-out


def _finish(process: subprocess.Popen, workdir: str, timeout: float) -> tuple[dict, str]:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    log = open(os.path.join(workdir, "log")).read()
    assert process.returncode == 0, f"torchrun exited with {process.returncode}:\n{log[-6000:]}"
    out = os.path.join(workdir, "final.pt")
    assert os.path.exists(out), f"torchrun wrote no {out}:\n{log[-6000:]}"
    return torch.load(out, weights_only=False), log


def test_torchrun_restarts_a_dead_rank_and_the_resumed_run_is_bitwise_equal(tmp_path):
    reference_dir, restarted_dir = str(tmp_path / "reference"), str(tmp_path / "restarted")
    jobs = [_torchrun(reference_dir), _torchrun(restarted_dir, "--kill-at", f"1:{KILL_STEP}")]
    try:
        reference, _ = _finish(jobs[0], reference_dir, timeout=150)
        restarted, log = _finish(jobs[1], restarted_dir, timeout=150)
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()

    assert reference["attempt"] == 0 and reference["resumed_from"] == 0
    assert f"rank 1 dies before step {KILL_STEP}" in log, log[-6000:]
    last_complete = KILL_STEP // SAVE_EVERY * SAVE_EVERY
    assert f"[attempt 1] resumed from {os.path.join(restarted_dir, 'ckpt', f'step{last_complete}')} " \
           f"(step {last_complete})" in log, log[-6000:]
    assert restarted["attempt"] == 1 and restarted["resumed_from"] == last_complete
    assert sorted(restarted["losses"]) == list(range(last_complete, STEPS))
    for step, loss in restarted["losses"].items():
        assert loss == reference["losses"][step], f"step {step}: {loss} != {reference['losses'][step]}"
    assert_tensors_equal(restarted["params"], reference["params"], "final parameter")
    for workdir in (reference_dir, restarted_dir):
        ckpt = os.path.join(workdir, "ckpt")
        assert sorted(os.listdir(ckpt)) == [f"step{s}" for s in range(SAVE_EVERY, STEPS, SAVE_EVERY)], workdir
        assert dynshard.checkpoint.latest(ckpt) == os.path.join(ckpt, f"step{STEPS // SAVE_EVERY * SAVE_EVERY}")
