"""The one parity assertion of the multi-rank tests: a run trains like one process.

A rank's result holds its losses and the one-process reference's (``losses``, ``ref_losses``) and the
whole parameters after training (``params``, e.g. ``dynshard.collect_state_dict``) next to the
reference's (``ref_params``). SGD with momentum is linear in the gradients, so parameters match to
rtol 1e-4 / atol 1e-6 (Adam would hide a gradient off by a constant factor); losses to rtol 1e-5.
"""

from __future__ import annotations

import torch


def assert_trains_like_one_process(result: dict, label: str = "", *, loss_rtol: float = 1e-5,
                                   rtol: float = 1e-4, atol: float = 1e-6, loss_keys=("losses",)) -> None:
    """``loss_keys``: the result's per-step values compared with their ``ref_`` twins (e.g. a router's
    auxiliary loss beside the loss)."""
    for key in loss_keys:
        torch.testing.assert_close(torch.as_tensor(result[key]), torch.as_tensor(result[f"ref_{key}"]),
                                   rtol=loss_rtol, atol=0, msg=lambda m, key=key: f"{label} {key}: {m}")
    assert result["params"].keys() == result["ref_params"].keys(), label
    for name, expected in result["ref_params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{label} {name}: {m}")
