"""The multi-rank harness itself: a job whose ranks do not all run fails the test that started it, and the one
parity assertion (tests/parity.py) fails a run off the project's standard."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from parity import (assert_tensors_equal, assert_trains_like_one_process, assert_updates_close, tensor_problems,
                    update_problems)
from workers import fail_on_rank_one


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 could not start"):
        run_ranks(fail_on_rank_one, 2)


# -- the one parity assertion (tests/parity.py) fails on what it is there to catch --------------------------
def _trained(scale: float = 1.0, **changes) -> dict:
    params = {"w": torch.linspace(-1, 1, 64).reshape(8, 8), "b": torch.linspace(0.5, 1, 8)}
    result = {"losses": [2.0, 1.5], "ref_losses": [2.0, 1.5], "params": {k: v * scale for k, v in params.items()},
              "ref_params": params}
    result.update(changes)
    return result


def test_the_parity_assertion_passes_a_run_within_the_standard():
    assert_trains_like_one_process(_trained(1 + 5e-5))


@pytest.mark.parametrize("result,match", [
    (_trained(1 + 2e-4), r"params w: Mismatched elements"),       # e.g. a gradient off by a constant factor
    (_trained(losses=[2.0, 1.5001]), r"losses: Mismatched elements: 1 / 2"),
    (_trained(losses=[2.0]), r"losses: The values for attribute 'shape' do not match"),
    (_trained(params={"w": torch.linspace(-1, 1, 64).reshape(8, 8)}), r"params: missing \['b'\]"),
    (_trained(params={"w": torch.full((8, 8), float("nan")), "b": torch.linspace(0.5, 1, 8)}), r"params w"),
])
def test_the_parity_assertion_fails_a_run_off_the_standard(result, match):
    with pytest.raises(AssertionError, match=match):
        assert_trains_like_one_process(result, "rank 0")


def test_an_adamw_update_is_held_in_norm_and_an_exact_comparison_bit_for_bit():
    start = {"w": torch.zeros(1000)}
    ref = {"w": torch.full((1000,), 1e-3)}
    near = {"w": ref["w"] + 1e-8 * torch.linspace(-1, 1, 1000)}            # 1e-5 of the update's norm
    assert_updates_close(near, ref, start)
    flipped = {"w": torch.cat([-ref["w"][:1], ref["w"][1:]])}              # one element of 1000 moved the other way
    assert update_problems(flipped, ref, start) and not update_problems(flipped, ref, start, rtol=0.1)
    with pytest.raises(AssertionError, match=r"param w: the update's norm is off by"):    # a step 5e-4 too long
        assert_updates_close({"w": ref["w"] * (1 + 5e-4)}, ref, start, "param")
    with pytest.raises(AssertionError, match=r"grads w: the tensor is off by"):
        assert_updates_close({"w": ref["w"] * 1.01}, ref, label="grads")
    assert_tensors_equal(ref, {"w": ref["w"].clone()})
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_tensors_equal(near, ref)
    assert tensor_problems({"w": torch.ones(2)}, {"w": torch.ones(3)}, "x", exact=True) == [
        "x w: not bitwise equal (shape (2,) vs (3,))"]
