"""The one parity assertion of the tests: a run trains like one process (or like the reference run it is
compared with), to the project's standard tolerances.

A rank's result holds its per-step losses and the one-process reference's (``losses``, ``ref_losses``) and
the whole parameters after training (``params``, e.g. ``dynshard.collect_state_dict``) next to the
reference's (``ref_params``); other tensors (``momentum``) and per-step values (a router's ``aux``) the
same way, each beside its ``ref_`` twin.

The standard:

* per-step losses: rtol 1e-5, atol 0 (``LOSS_RTOL``);
* SGD with momentum: every tensor element by element, rtol 1e-4 / atol 1e-6 (``RTOL``, ``ATOL``). SGD with
  momentum is linear in the gradients, so a gradient off by a constant factor shows (Adam would hide it);
* AdamW: losses as above; each tensor's update compared as a whole, as a vector,
  ``norm(update - ref_update) / norm(ref_update) <= UPDATE_RTOL`` (1e-3), and in size,
  ``|norm(update) - norm(ref_update)| / norm(ref_update) <= UPDATE_NORM_RTOL`` (1e-4). AdamW divides by
  ``sqrt(exp_avg_sq)``: an element whose gradient is zero up to rounding (attention's key bias: softmax
  ignores it) moves by its rounding noise, so elements alone cannot be held to a tolerance, and that
  noise sets the vector's: the GPT's c_attn.bias is off by up to 2.8e-4 of its update after two steps
  resumed from a checkpoint under another plan (tests/test_checkpoint_matrix.py), its norm by 1.4e-6.
  Gradients may be compared the same way (``start=None``: an update from zero).

A test may hold a check tighter than this; one looser says why beside it. ``*_problems`` return the
failures as lines (for a test that reports a whole table); ``assert_*`` raise them all at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LOSS_RTOL = 1e-5
RTOL, ATOL = 1e-4, 1e-6
UPDATE_RTOL, UPDATE_NORM_RTOL = 1e-3, 1e-4


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines()]
    return "; ".join(line for line in lines if line and not line.endswith("are not close!"))


def _values(values) -> torch.Tensor:
    """Per-step values (floats, tensors, lists of them, a step's list of micro-batch losses) as one flat
    tensor, Python floats in float64."""
    if isinstance(values, torch.Tensor):
        return values.detach().flatten()
    if isinstance(values, (list, tuple)):
        parts = [_values(v) for v in values]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)
    return torch.tensor([float(values)], dtype=torch.float64)


def _key_problems(got: Mapping, expected: Mapping, label: str) -> list[str]:
    if got.keys() == expected.keys():
        return []
    return [f"{label}: missing {sorted(expected.keys() - got.keys())}, "
            f"not in the reference {sorted(got.keys() - expected.keys())}"]


def loss_problems(got, expected, label: str = "losses", *, rtol: float = LOSS_RTOL, atol: float = 0.0) -> list[str]:
    """Per-step values (losses) against the reference's, in order."""
    try:
        torch.testing.assert_close(_values(got), _values(expected), rtol=rtol, atol=atol, check_dtype=False)
    except AssertionError as error:
        return [f"{label}: {_one_line(error)} (got {_values(got).tolist()}, reference {_values(expected).tolist()})"]
    return []


def tensor_problems(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], label: str = "", *,
                    rtol: float = RTOL, atol: float = ATOL, exact: bool = False) -> list[str]:
    """Two dicts of tensors hold the same names and, element by element, the same values (``exact``: bit for
    bit, ``torch.equal``)."""
    problems = _key_problems(got, expected, label)
    for name, want in expected.items():
        if name not in got:
            continue
        have = got[name]
        if exact:
            if not torch.equal(have, want):
                detail = (f"shape {tuple(have.shape)} vs {tuple(want.shape)}" if have.shape != want.shape
                          else f"max |difference| {float((have.double() - want.double()).abs().max()):.3g}")
                problems.append(f"{label} {name}: not bitwise equal ({detail})")
            continue
        try:
            torch.testing.assert_close(have, want, rtol=rtol, atol=atol)
        except AssertionError as error:
            problems.append(f"{label} {name}: {_one_line(error)}")
    return problems


def update_problems(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                    start: Mapping[str, torch.Tensor] | None = None, label: str = "", *,
                    rtol: float = UPDATE_RTOL, norm_rtol: float = UPDATE_NORM_RTOL) -> list[str]:
    """Each tensor's update from ``start`` (AdamW's parameters) against the reference's: the difference
    within ``rtol`` of the reference update's norm, and the update's norm within ``norm_rtol`` of it;
    without ``start``, the tensors themselves (gradients)."""
    problems = _key_problems(got, expected, label)
    for name, want in expected.items():
        if name not in got:
            continue
        have, want = got[name].double(), want.double()
        if have.shape != want.shape:
            problems.append(f"{label} {name}: shape {tuple(have.shape)} vs {tuple(want.shape)}")
            continue
        ref_update = want - start[name].double() if start is not None else want
        update = have - start[name].double() if start is not None else have
        off, size = float(torch.linalg.vector_norm(have - want)), float(torch.linalg.vector_norm(ref_update))
        size_off = abs(float(torch.linalg.vector_norm(update)) - size)
        what = "update" if start is not None else "tensor"
        if not off <= rtol * size:      # (a NaN fails)
            ratio = off / size if size else float("inf")
            problems.append(f"{label} {name}: the {what} is off by {off:.3g}, {ratio:.3g} of its norm {size:.3g} "
                            f"(up to {rtol:g} allowed)")
        elif not size_off <= norm_rtol * size:
            problems.append(f"{label} {name}: the {what}'s norm is off by {size_off:.3g}, "
                            f"{size_off / size:.3g} of {size:.3g} (up to {norm_rtol:g} allowed)")
    return problems


def _raise(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


def assert_losses_close(got, expected, label: str = "losses", *, rtol: float = LOSS_RTOL, atol: float = 0.0) -> None:
    _raise(loss_problems(got, expected, label, rtol=rtol, atol=atol))


def assert_tensors_close(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], label: str = "", *,
                         rtol: float = RTOL, atol: float = ATOL) -> None:
    _raise(tensor_problems(got, expected, label, rtol=rtol, atol=atol))


def assert_tensors_equal(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                         label: str = "") -> None:
    """Bit for bit (a resumed run, a checkpoint's contents)."""
    _raise(tensor_problems(got, expected, label, exact=True))


def assert_updates_close(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                         start: Mapping[str, torch.Tensor] | None = None, label: str = "", *,
                         rtol: float = UPDATE_RTOL) -> None:
    _raise(update_problems(got, expected, start, label, rtol=rtol))


def assert_trains_like_one_process(result: dict, label: str = "", *, loss_rtol: float = LOSS_RTOL,
                                   rtol: float = RTOL, atol: float = ATOL, loss_keys=("losses",),
                                   tensor_keys=("params",)) -> None:
    """``loss_keys``: the result's per-step values compared with their ``ref_`` twins (e.g. a router's
    auxiliary loss beside the loss); ``tensor_keys``: its dicts of tensors compared so (the parameters, an
    optimizer's momentum buffers)."""
    problems = []
    for key in loss_keys:
        problems += loss_problems(result[key], result[f"ref_{key}"], f"{label} {key}".strip(), rtol=loss_rtol)
    for key in tensor_keys:
        problems += tensor_problems(result[key], result[f"ref_{key}"], f"{label} {key}".strip(), rtol=rtol, atol=atol)
    _raise(problems)


def assert_ranks_train_like_one_process(results: list[dict], **tolerances) -> None:
    """:func:`assert_trains_like_one_process` on each rank's result, labelled with its rank."""
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}", **tolerances)


def assert_parity_job_trains_like_one_process(results: list[dict]) -> None:
    """Each rank's ``workers.train_parity`` result: its state dict relocated onto its shards is its shards, and
    AdamW's parameters held element by element, rtol 1e-5 (tighter than SGD's standard) and atol 1e-5: AdamW's
    first steps move each element by ~lr whatever the gradient's size, so a gradient that is zero up to
    rounding may move either way; 1e-5 is 1% of one step."""
    for rank, result in enumerate(results):
        assert result["relocated_equals_local"], f"rank {rank}: relocate_state_dict(collect_state_dict(m)) != shards"
    assert_ranks_train_like_one_process(results, rtol=1e-5, atol=1e-5)
