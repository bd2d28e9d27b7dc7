"""ZeRO-3's "reshard after forward" as recompute tags on aot_autograd's joint graph.

Left alone, the partitioner saves every collective's output for the backward (it may not decide by
itself to re-communicate: ranks compiling independently could disagree and hang), so a gathered
parameter would live from the forward to the backward: ZeRO-2's memory. At level 3 the all-gather of
each ZeRO-split parameter, the cast before it and every single-input op after it (narrow, views) are
tagged ``MUST_RECOMPUTE``: the forward frees the whole parameter after use and the backward gathers it
again where it needs it. Tags are decided from the graph alone, so every rank makes the same choice.
This is what SimpleFSDP (torchtitan) and autoparallel do; one ``ac_graph_id`` far from user regions
keeps the partitioner from merging these with user checkpoints.
"""

from __future__ import annotations

from typing import Callable, Collection

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import compat

RESHARD_GRAPH_ID = 100000


def tag_reshard_after_forward(graph: fx.Graph, zero_groups: Collection[str]) -> int:
    """Tag the gather chains of ZeRO-split parameters for recomputation; returns how many gathers."""
    tagged = 0
    for gather in graph.nodes:
        if gather.target is not compat.ALL_GATHER or gather.args[-1] not in zero_groups:
            continue
        chain = [gather]
        source = gather.args[0]
        while isinstance(source, fx.Node) and source.op == "call_function" and len(source.all_input_nodes) == 1:
            chain.append(source)          # the cast to the compute dtype (and any view) before the gather
            source = source.all_input_nodes[0]
        if not (isinstance(source, fx.Node) and source.op == "placeholder"):
            continue
        frontier = list(gather.users)     # the wait, then every op that reads nothing but the gathered value
        while frontier:
            node = frontier.pop()
            if node in chain or node.op != "call_function" or len(node.all_input_nodes) != 1:
                continue
            chain.append(node)
            frontier.extend(node.users)
        for node in chain:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = RESHARD_GRAPH_ID
        tagged += 1
    return tagged


def reshard_pass(zero_groups: Collection[str]) -> Callable[[fx.GraphModule], None]:
    """Runs on every joint graph right before it is partitioned: the program's, and each outlined block's
    (whose parameters' gathers are inside it, see outline_repeated_blocks)."""
    groups = frozenset(zero_groups)

    def reshard_after_forward(joint: fx.GraphModule) -> None:
        tag_reshard_after_forward(joint.graph, groups)
    return reshard_after_forward


