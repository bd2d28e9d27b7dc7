"""The batch's positions: ``torch.arange(batch_size)`` of a symbolic graph, and indexing the batch's rows with it.

transformers' attention masks read the padding mask by the batch's positions (``masking_utils.sdpa_mask``)::

    batch_arange = torch.arange(batch_size)
    padding_mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]

In a graph Dynamo traced with a symbolic batch, ``batch_size`` is the batch's size input, and a pipeline
divides that input with the batch (``PipelineProgram.split``): each micro-batch's program computes
``arange(B / m)`` and reads its own rows, which are the rows of the whole batch's result. So
:mod:`.microbatch_outputs` places the positions as ``Shard(0)`` holding each micro-batch's local values,
follows them through getitems that only slice whole and add dimensions (``[:, None, None, None]``), and runs
a getitem whose first index is such positions, over a value split along dim 0, on each micro-batch's local
tensors: its result is split along dim 0 too. A replicated value (one that does not depend on the batch,
transformers' ``position_ids`` expanded over it) is indexed by ``arange(B)`` as a replicated value, as the
analysis ran it before. Anything else computed from the positions is refused: the
micro-batches' positions concatenated are not the batch's (``positions == 0`` is true on the first row of
every micro-batch, not of the batch only). A static graph holds the batch size as a number, not this
input: its ``arange(B)`` is a constant, and indexing with it is refused as before.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import compat

__all__ = ["NOT_HERE", "BatchPositions"]

NOT_HERE = object()      # the node runs as it is


class BatchPositions:
    """The nodes of a graph that hold the batch's positions, and how the micro-batch analysis runs them.

    ``batch_sizes``: the graph's size inputs that are the batch's (placeholders); ``refuse(reason)``: the
    analysis's error for the node running now."""

    def __init__(self, batch_sizes: set[fx.Node], mesh, refuse: Callable[[str], Exception]):
        self.batch_sizes = batch_sizes
        self.mesh = mesh
        self.refuse = refuse
        self.nodes: set[fx.Node] = set()
        # each positions node as a value that does not depend on the batch (the whole batch's arange(B)): what
        # indexes a replicated value, which every micro-batch reads alike, as the analysis ran it before
        self.replicated: dict[fx.Node, Any] = {}

    def run(self, node: fx.Node, fetch: Callable[[fx.Node], tuple]) -> Any:
        """``node``'s value where it makes the positions or indexes the batch's rows with them (``fetch(node)``:
        its arguments' values, and keyword arguments'); :data:`NOT_HERE` where it runs as it is (a view of the
        positions is followed)."""
        if not self.batch_sizes or node.op != "call_function":
            return self._check_unused(node)
        if node.target is torch.arange and self._is_positions(node):
            self.nodes.add(node)
            (size,), _ = fetch(node)
            self.replicated[node] = torch.arange(int(size), device="meta")     # (the mode replicates it)
            with compat.outside_dispatch_modes():
                local = torch.arange(int(size) // self.mesh.size(), device="meta")
                return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)
        if node.target is operator.getitem and self._holds(node.args[0]) and _only_views(node.args[1]):
            self.nodes.add(node)
            self.replicated[node] = self.replicated[node.args[0]][node.args[1]]
            return NOT_HERE
        if node.target is operator.getitem and isinstance(node.args[1], tuple) and node.args[1] \
                and self._holds(node.args[1][0]):
            (value, index), _ = fetch(node)
            if isinstance(value, DTensor) and value.placements == (Replicate(),):
                return value[tuple(self.replicated[a] if self._holds(a) else i for a, i in zip(node.args[1], index))]
            return self._index_rows(value, index)
        return self._check_unused(node)

    def _holds(self, arg) -> bool:
        return isinstance(arg, fx.Node) and arg in self.nodes

    def _is_positions(self, node: fx.Node) -> bool:
        """``torch.arange(batch_size)``: one positional argument, the batch's size input."""
        return len(node.args) == 1 and node.args[0] in self.batch_sizes and not (
            set(node.kwargs) - {"device", "dtype"}) and node.kwargs.get("dtype") in (None, torch.int64)

    def _index_rows(self, value, index: tuple) -> Any:
        if not isinstance(value, DTensor) or value.placements != (Shard(0),):
            raise self.refuse("it indexes a value that is neither split along the batch nor replicated with the "
                              "batch's positions (torch.arange over the batch size)")
        positions = index[0]
        others = [i for i in index[1:] if isinstance(i, torch.Tensor)]
        for other in others:
            offset = other.dim() - positions.dim()
            if not isinstance(other, DTensor) or other.placements[0].is_shard() or offset > 0 or (
                    offset == 0 and other.shape[0] != 1):
                raise self.refuse("it indexes the batch's rows with the batch's positions together with an index "
                                  "that is split along the batch or spans its dimension")
        with compat.outside_dispatch_modes():       # each micro-batch's rows, by its own positions
            local = value.to_local()[tuple(i.to_local() if isinstance(i, DTensor) else i for i in index)]
            return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)

    def _check_unused(self, node: fx.Node) -> Any:
        used = [a for a in node.all_input_nodes if a in self.nodes]
        if used and node.op != "output":
            raise self.refuse(f"it computes with the batch's positions ({used[0].name}, torch.arange over the batch "
                              "size) other than to index the batch's rows; each micro-batch's positions start at 0, "
                              "so the result is not the batch's")
        return NOT_HERE


def _only_views(index) -> bool:
    """``[:, None, None, None]``: whole slices and new dimensions, the first entry a whole slice."""
    entries = index if isinstance(index, tuple) else (index,)
    whole = slice(None, None, None)
    return bool(entries) and entries[0] == whole and all(e is None or e == whole for e in entries)

