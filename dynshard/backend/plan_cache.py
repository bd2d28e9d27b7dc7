"""Plans keyed on what decides them: graph structure, global input shapes, config and world layout.

In memory a hit returns the compiled program itself (the re-trace that follows the in-place sharding of
parameters never compiles twice). On disk (``Config.cache_dir``) the :class:`~dynshard.planning.Plan` is
kept as its JSON, so a restarted job skips the policy search. The same JSON is what rank 0 sends the other
ranks of a job (see :class:`.agreement.PlanChannel`), and what plan files hold: a received, stored or
loaded plan is installed alike.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import torch
from .. import compat
from ..config import Config
from ..planning import Plan
from ..runtime.job import current_job
from ..runtime.mesh import Layout
from .capture import GraphInput


def plan_key(code: str, inputs: Sequence[GraphInput], config: Config, layout: Layout,
             given_plan: str | None = None) -> str:
    """``given_plan``: the digest of a plan loaded from a file (an edited plan is another program)."""
    parts = [code, *(inp.token() for inp in inputs), config.cache_token(), layout.token(),
             torch.__version__, modes_token(), given_plan or ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def modes_token() -> str:
    """The ambient state that changes the traced program while Dynamo's graph stays the same: grad mode,
    autocast (aot_autograd applies it while tracing) and the default dtype (factory calls)."""
    autocast = ",".join(f"{device}:{dtype}" for device, dtype in sorted(compat.autocast_state().items()))
    return f"grad={torch.is_grad_enabled()} autocast={autocast or 'off'} default_dtype={torch.get_default_dtype()}"


class PlanCache:
    """The job's programs by plan key, and its families' first programs: a part of the job (:func:`job_plans`),
    since a program holds the job's process groups and a family the number of one of its agreed compiles."""

    def __init__(self) -> None:
        self._memory: dict[str, Any] = {}
        self._families: dict[str, tuple[Any, int]] = {}    # family -> (its first program, its agreed compile)

    def get(self, key: str) -> Any:
        return self._memory.get(key)

    def put(self, key: str, plan: Any) -> None:
        self._memory[key] = plan

    def programs(self) -> list[Any]:
        """The job's compiled programs, in the order they were compiled."""
        return list(self._memory.values())

    def family(self, family: str | None) -> tuple[Any, int] | None:
        """The first program of ``family`` every rank agreed on, and that compile's number (see .families)."""
        return None if family is None else self._families.get(family)

    def add_family(self, family: str, plan: Any, compile_index: int) -> None:
        self._families.setdefault(family, (plan, compile_index))


def job_plans() -> PlanCache:
    """The current job's plan cache."""
    return current_job().part(PlanCache)


# -- plans on disk --------------------------------------------------------------------------------------
def _load_text(config: Config, key: str) -> str | None:
    """The JSON text stored for ``key`` in ``cache_dir`` (placements, or a pipeline's stage cut), or None."""
    if not config.cache_dir:
        return None
    path = os.path.join(config.cache_dir, f"plan-{key}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _save_text(config: Config, key: str, text: str, layout: Layout) -> None:
    """Rank 0 keeps ``text`` for ``key`` in ``cache_dir`` (written atomically)."""
    if not config.cache_dir or layout.rank != 0:
        return
    os.makedirs(config.cache_dir, exist_ok=True)
    path = os.path.join(config.cache_dir, f"plan-{key}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_plan(config: Config, key: str) -> Plan | None:
    """The plan stored for ``key`` in ``cache_dir``, None when it holds none."""
    text = _load_text(config, key)
    if text is None or '"dynshard_plan"' not in text:     # (an older dynshard's placements: planned again)
        return None
    return Plan.from_json(text, f"the stored plan {os.path.join(config.cache_dir, f'plan-{key}.json')} "
                                "(remove it from cache_dir)")


def save_plan(config: Config, key: str, plan: Plan, layout: Layout) -> None:
    _save_text(config, key, plan.to_json(), layout)
