"""dynshard's functions in a program are named by what they capture, so that aot_autograd's cache keys
tell apart programs that differ only there (what several ranks share is in test_compile_cache.py)."""

from __future__ import annotations

import os

import workers_aot_cache as workers
from distributed import run_ranks

from dynshard.backend.compiler import shared_compiles


def test_program_functions_are_named_by_their_code_and_captured_state(tmp_path):
    run_ranks(workers.names_functions_by_what_they_capture, 1, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})


def test_ranks_share_traces_where_they_outnumber_the_hosts_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert shared_compiles.traces_shared(None)
    assert not shared_compiles.traces_shared(False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert not shared_compiles.traces_shared(None)
    assert shared_compiles.traces_shared(True)
