"""A job's plan files: the plans ``load_plan_path`` gives (read once per job by rank 0, sent to the others)
and the plans ``save_plan_path`` collects (rank 0 rewrites the file as each new graph is planned)."""

from __future__ import annotations

from typing import Sequence

from ..config import Config
from ..planning import Plan, TensorChoice
from ..planning.files import parse_plans, plan_for_graph, read_plan_file, write_plan_file
from ..planning.plan import MadeFor
from ..runtime.job import current_job
from .agreement import from_rank0
from .capture import GraphInput


class PlanFiles:
    """The plans of the job's plan files, by path: a part of the job (:func:`job_plan_files`), since the file
    ``load_plan_path`` names is read once per job and the one ``save_plan_path`` names holds its plans."""

    def __init__(self) -> None:
        self._loaded: dict[str, list[Plan]] = {}
        self._saved: dict[str, list[Plan]] = {}

    def given(self, config: Config, made_for: MadeFor, inputs: Sequence[GraphInput]) -> Plan | None:
        """The plan ``load_plan_path`` holds for this graph (None without a file)."""
        path = config.load_plan_path
        if path is None:
            return None
        if path not in self._loaded:
            self._loaded[path] = parse_plans(from_rank0(lambda: read_plan_file(path)), path)
        return plan_for_graph(self._loaded[path], path, made_for, graph_tensors(inputs))

    def record(self, config: Config, plan: Plan | None, rank: int) -> None:
        """Rank 0 keeps ``plan`` in ``save_plan_path`` (a plan made again for the same graph replaces it)."""
        path = config.save_plan_path
        if path is None or plan is None or rank != 0:
            return
        plans = self._saved.setdefault(path, [])
        same = [i for i, p in enumerate(plans) if p.made_for == plan.made_for and list(p.tensors) == list(plan.tensors)]
        if same:
            plans[same[0]] = plan
        else:
            plans.append(plan)
        write_plan_file(path, plans)


def job_plan_files() -> PlanFiles:
    """The current job's plan files."""
    return current_job().part(PlanFiles)


def graph_tensors(inputs: Sequence[GraphInput]) -> dict[str, TensorChoice]:
    """The graph's inputs as a plan lists them (names, kinds, shapes, dtypes), to match a plan against."""
    return {inp.name: TensorChoice.of(inp) for inp in inputs}
