"""``dynshard.why_not(model, args, config, world_size, placements)``: what a placement the plan did not take
would cost ("why did it replicate this?").

The plan is made twice offline (``dynshard.plan``): as ``config`` makes it, and with ``placements`` pinned
(``Config.partition_constraints``: parameter or module patterns to "replicate" or "S<dim>"). Under autodist
the second search finds the best plan that holds the pins; under a hand policy the policy plans around
them. Both are priced by the same cost model, and the answer is the difference: step seconds and peak
bytes per rank, per program, or why no plan holding the pins fits.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import torch

from .autodist import AutodistError
from .backend.offline import plan as make_plans
from .config import Config
from .config.pins import check_pins, pin_of
from .planning import Plan
from .autodist.device_profile import DeviceProfile


def why_not(model: torch.nn.Module, args: Sequence[Any], config: Config | Mapping[str, Any], world_size: int,
            placements: Mapping[str, str], kwargs: Mapping[str, Any] | None = None,
            device_profile: str | os.PathLike | DeviceProfile | None = "cpu") -> str:
    """The predicted cost of ``config``'s plans beside the plans that hold ``placements`` (pins, as
    ``Config.partition_constraints`` takes them), as text. ``device_profile`` prices a hand policy's plans
    (autodist uses its ``pas_config['device_profile']``)."""
    config = Config.from_options(config)
    pins = check_pins(placements, "why_not's placements")
    profile = None if config.policy == "autodist" else device_profile
    chosen = make_plans(model, args, config, world_size, kwargs, device_profile=profile)
    pinned_config = dataclasses.replace(config, partition_constraints={**config.partition_constraints, **pins})
    what = ", ".join(f"{pattern} -> {'replicate' if code == 'R' else code}" for pattern, code in pins.items())
    try:
        pinned = make_plans(model, args, pinned_config, world_size, kwargs, device_profile=profile)
    except Exception as error:      # noqa: BLE001 - a search that finds nothing is the answer
        cause = _autodist_error(error)
        if cause is None:
            raise
        return f"with {what}: no plan fits: {cause}"
    lines = []
    for index, (plan, other) in enumerate(zip(chosen, pinned)):
        lines.append(f"program {index}: {_describe(plan)}")
        lines.append(f"  with {what}: {_describe(other, plan)}")
        moved = [name for name, t in other.tensors.items() if name in plan.tensors and plan.tensors[name].tp != t.tp]
        moved.sort(key=lambda name: pin_of(name, pins) is None)      # (the pinned tensors first, then the rest)
        lines.append(f"  {len(moved)} tensor(s) placed otherwise" + (f": {', '.join(moved[:8])}" + (
            ", ..." if len(moved) > 8 else "") if moved else ""))
    return "\n".join(lines)


def _describe(plan: Plan, against: Plan | None = None) -> str:
    p = plan.predicted.cost
    if p is None:
        return f"policy {plan.policy} (not predicted: a hybrid pipeline)"
    record = plan.predicted.autodist
    name = f"autodist chose {record.chosen}" if record is not None else f"policy {plan.policy}"
    step, peak = p.step_seconds, p.bytes_per_rank.peak
    text = f"{name}, {step:.4g} s a step, peak {peak} bytes per rank"
    if against is not None and against.predicted.cost is not None:
        base = against.predicted.cost
        text += (f" ({step / base.step_seconds - 1:+.0%} time, "
                 f"{peak / base.bytes_per_rank.peak - 1:+.0%} memory)")
    return text


def _autodist_error(error: BaseException) -> AutodistError | None:
    """The AutodistError inside what Dynamo raised (it wraps a backend's error)."""
    while error is not None and not isinstance(error, AutodistError):
        error = error.__cause__ or getattr(error, "inner_exception", None)
    return error
