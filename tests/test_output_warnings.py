"""Outputs split inside the unit that every step gathers whole (full logits, a KV cache left on while
training) are named in a warning with their bytes per step and the fix."""

from __future__ import annotations

from distributed import run_ranks
from workers_outputs import warnings_of_a_step
from workers_transformers import ROWS, SEQ, VOCAB


def test_logits_and_a_kv_cache_gathered_every_step_are_named_with_their_bytes_and_the_fix():
    for with_cache, without in zip(run_ranks(warnings_of_a_step, 2, True), run_ranks(warnings_of_a_step, 2, False)):
        assert len(with_cache) == 1 and len(without) == 1, (with_cache, without)
        logits = f"float32[{ROWS}, {SEQ}, {VOCAB}]"
        assert logits in with_cache[0] and logits in without[0]
        assert "use_cache=False" in with_cache[0] and "gather_outputs=False" in with_cache[0]
        # GPT-2's cache: a key and a value per layer, split by heads, each [rows, heads, seq, head_dim]
        assert with_cache[0].count("float32[2, 4, 16, 8]") == 4, with_cache[0]
        assert "float32[2, 4, 16, 8]" not in without[0]
