"""The ops dynshard's traced graphs hold, as torch 2.13 names them: the functional collectives
(``torch.ops._c10d_functional``) and ``invoke_subgraph``, with the process-group look-ups and registrations
behind a collective's group name. Re-exported by :mod:`dynshard.compat`; the other compat modules import from here,
not from the package (which imports them).
"""

from __future__ import annotations

from typing import Any

import torch

_c10d = torch.ops._c10d_functional

# Functional collectives as they appear in traced graphs, by the name dynshard reports them under.
COLLECTIVE_KINDS: dict[Any, str] = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_reduce_.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
}
ALL_GATHER = _c10d.all_gather_into_tensor.default
if hasattr(_c10d, "all_reduce_coalesced"):
    COLLECTIVE_KINDS[_c10d.all_reduce_coalesced.default] = "all_reduce"

# the higher-order op behind ``torch.compiler.nested_compile_region``: ``invoke_subgraph(subgraph,
# identifier, *operands)``; aot_autograd traces and partitions each identifier once, Inductor emits it once
invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def all_gather_rows(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Functional all-gather along dim 0 (traceable: aot_autograd records it as it is)."""
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(tensor.contiguous(), group_size, group_name))


def reduce_scatter_rows(tensor: torch.Tensor, group_size: int, group_name: str, op: str = "sum") -> torch.Tensor:
    """Functional reduce-scatter (``op``: "sum" or "avg") along dim 0."""
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(tensor.contiguous(), op, group_size, group_name))


def all_to_all_rows(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group_name: str) -> torch.Tensor:
    """Functional all-to-all along dim 0: ``input_splits[d]`` rows go to rank ``d``, ``output_splits[s]`` rows
    come from rank ``s``, in rank order."""
    return _c10d.wait_tensor(_c10d.all_to_all_single(tensor.contiguous(), output_splits, input_splits, group_name))


def all_reduce(tensor: torch.Tensor, group_name: str, op: str) -> torch.Tensor:
    """Functional all-reduce (``op``: "sum", "avg", ...)."""
    return _c10d.wait_tensor(_c10d.all_reduce(tensor.contiguous(), op, group_name))


def group_rank(group_name: str) -> int:
    """This process's rank in the process group registered as ``group_name`` (functional collectives' name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_rank(_resolve_process_group(group_name))


def resolve_process_group(group_name: str):
    """The process group registered as ``group_name`` (c10d's ``_resolve_process_group``); None where none is."""
    from torch._C._distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        return None


def register_process_group_name(group_name: str, group) -> None:
    """``group`` registered on this rank as ``group_name`` (c10d's ``_register_process_group``), replacing what
    c10d keeps under that name (a destroyed group's)."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    _unregister_process_group(group_name)
    _register_process_group(group_name, group)


def process_group_names() -> list[str]:
    """The names of every process group of this process (``distributed_c10d._world.pg_names``)."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_names.values())
