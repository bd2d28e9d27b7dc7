"""The vocabulary-parallel masks read the rank's offset when the program runs: every tp coordinate
compiles the same program (and so shares every generated kernel), computing what torch computes."""

from __future__ import annotations

import torch

from distributed import run_ranks
from workers_mesh_coordinate import TABLE_ROWS, masked_indices, tp_programs


def test_masks_with_the_offset_read_at_run_time_equal_torchs():
    for rank, result in enumerate(run_ranks(masked_indices, 2)):
        assert len(result) == 3 * len(TABLE_ROWS)
        for (rows, kind), ((torch_masked, torch_mask), (masked, mask, read_at_run_time)) in result.items():
            # (a descending mesh keeps torch's masking: a rank's index in the group is not its coordinate)
            assert read_at_run_time == (kind != "descending mesh"), (rank, rows, kind)
            assert torch.equal(mask, torch_mask), (rank, rows, kind)
            assert torch.equal(masked, torch_masked), (rank, rows, kind)
            assert masked.dtype == torch_masked.dtype


def test_tensor_parallel_coordinates_compile_the_same_forward_graph():
    first, second = run_ranks(tp_programs, 2, "aot_eager")
    assert set(first) == {"forward", "backward"}
    assert "dynshard.mesh_coordinate" in first["forward"]
    # (the backward still takes this coordinate's rows of the tied embedding's gradient as split[coordinate],
    # a view: on the benchmark GPT Inductor generates the same backward kernels on both coordinates)
    assert first["forward"] == second["forward"]
