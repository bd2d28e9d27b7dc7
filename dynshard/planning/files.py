"""Plan files (``Config.save_plan_path`` / ``Config.load_plan_path``).

A plan file holds the plans of one job, in the order their graphs were first compiled: one plan object
(the text ``Plan.to_json()`` gives) when the job compiles one graph, else a JSON list of them. A job that
loads a file picks, for each graph it compiles, the plan made for that graph (its fingerprint: the graph's
code, its inputs' names, shapes and dtypes, the world size and the grad/autocast mode); a graph no plan in
the file fits is an error that names the file and the first mismatch.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from .plan import MadeFor, Plan, PlanFileError, TensorChoice, first_mismatch, format_json


def read_plan_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as error:
        raise PlanFileError(f"dynshard: cannot read the plan file {path} ({error.strerror or error}); "
                            "check Config.load_plan_path / DYNSHARD_LOAD_PLAN_PATH") from None


def parse_plans(text: str, path: str) -> list[Plan]:
    """The plans in a plan file's text (one plan, or a list of them)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFileError(f"dynshard: the plan file {path} is not valid JSON ({error}); it is not a dynshard "
                            "plan file or it was cut short") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise PlanFileError(f"dynshard: the plan file {path} holds no plan")
    return [Plan.from_dict(item, f"the plan file {path}" + (f" (plan #{i})" if len(items) > 1 else ""))
            for i, item in enumerate(items)]


def plans_to_json(plans: Sequence[Plan]) -> str:
    """A plan file's text: the one plan as ``to_json`` writes it, or a list of plans."""
    if len(plans) == 1:
        return plans[0].to_json()
    return "[\n" + ",\n".join(format_json(p.to_dict()) for p in plans) + "\n]\n"


def write_plan_file(path: str, plans: Sequence[Plan]) -> None:
    """Written atomically: a job that stops mid-write leaves the previous file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(plans_to_json(plans))
    os.replace(tmp, path)


def plan_for_graph(plans: Sequence[Plan], path: str, made_for: MadeFor,
                   tensors: Mapping[str, TensorChoice]) -> Plan:
    """The plan in ``plans`` made for this graph; else an error naming the file and the first mismatch."""
    mismatches = []
    for plan in plans:
        mismatch = first_mismatch(plan, made_for, tensors)
        if mismatch is None:
            return plan
        mismatches.append(mismatch)
    which = "its plan" if len(plans) == 1 else f"none of its {len(plans)} plans fits; the first"
    raise PlanFileError(
        f"dynshard: the plan file {path} was not made for this graph: {which}: {mismatches[0]}. Make the plan "
        "for this model, input shapes and world (dynshard.plan(..., world_size=N), or a run with save_plan_path), "
        "or load the file made for it")
