"""Policies decide how a plan unit splits the graph. See :mod:`.plan_builder` for the policy API."""

from __future__ import annotations

from typing import Callable

from ..config import Config
from .data_parallel import data, dp
from .megatron import tp
from .plan_builder import PlanBuilder, PlanError
from .tensor_parallel import tensor_parallel

BUILTIN: dict[str, Callable[[PlanBuilder, Config], None]] = {"dp": dp, "data": data, "tp": tp}


def resolve(config: Config) -> Callable[[PlanBuilder, Config], None]:
    return BUILTIN[config.policy] if isinstance(config.policy, str) else config.policy


__all__ = ["BUILTIN", "PlanBuilder", "PlanError", "resolve", "dp", "data", "tp", "tensor_parallel"]
