"""Propagation replays a repeated layer whose inputs arrive as an earlier one's did (:mod:`dynshard.passes.layer_memo`):
what it records must be what running every op records, for every kind of candidate a search places."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers_op_placement import layers_replayed_as_run


@pytest.mark.parametrize("model_name", ["gpt", "fused-gpt", "llama", "llama-mqa", "gpt2-dropout"])
def test_replayed_layers_record_what_running_every_op_records(model_name):
    """Three layers: the second and third are replayed under tp, tp + sequence parallel, tp + batch parallel,
    data and the per-op ILP's plan; placements, collectives (in order), local reshards, fallbacks, reduced partial
    sums, random draws and matched slices equal those of a propagation that runs every op."""
    found = run_ranks(layers_replayed_as_run, 1, model_name, timeout=300)[0]
    for candidate, (differ, replayed, _) in found.items():
        assert (candidate, differ, replayed) == (candidate, [], 2)
    records = found["tp"][2]
    if model_name == "llama-mqa":       # the one key/value head sliced like the query heads, in each layer
        assert records["matched_slices"] == 6
    if model_name == "gpt2-dropout":    # attention dropout on split heads: drawn whole, in each layer
        assert records["drawn_whole"] == 3 and records["fallbacks"] > 0
