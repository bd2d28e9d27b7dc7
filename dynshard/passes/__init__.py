"""The passes, in four phases, each a list run whole: ``(graph_module, context) -> graph_module`` each.

- ``LOWER``: the Dynamo graph -> an ATen graph on FakeTensors at global shapes, fused ops split. Nothing in
  it depends on the policy, so one lowered graph serves every policy a search tries.
- ``PLACE``: the policy's decisions (or a given plan's): ``ctx.plan``, the value the ranks agree on.
- ``PROPAGATE``: DTensor's propagation of those placements to every node (``ctx.propagation``): what the
  plan costs, where it needs collectives. Planning (offline, autodist's candidates) stops here.
- ``REWRITE``: -> the per-rank program, local tensors in and out, and what only the program needs.

The compile path runs them in order (:mod:`dynshard.backend.plan_and_compile`), with the plan agreed across
ranks between ``LOWER`` and ``PROPAGATE`` (:mod:`dynshard.backend.plan_once`).

Each pass is timed into ``ctx.timings`` and logged (``TORCH_LOGS=+dynshard``); the graph it leaves is printed
with ``TORCH_LOGS=+dynshard.passes`` and written to torch's structured trace (``TORCH_TRACE=dir``: tlparse
lists each as an artifact ``dynshard_after_<pass>``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch.fx as fx

from .. import compat
from .assign_placements import assign_placements
from .cast_to_compute_dtype import cast_to_compute_dtype
from .causal_masks import recognize_causal_masks
from .eager_attention import fold_eager_attention
from .grouped_query_attention import fold_repeated_kv
from . import cpu_attention  # noqa: F401  (DTensor's strategies and FLOP formulas of CPU attention, at import)
from .context import PassContext
from .exact_mean_losses import exact_mean_losses
from .insert_collectives import insert_collectives
from .lower_to_aten import lower_to_aten
from .outline_repeated_blocks import outline_repeated_blocks
from .propagate_sharding import propagate_sharding
from .split_fused_experts import split_fused_experts
from .split_fused_projections import split_fused_projections
from .tag_recompute import tag_recompute
from .warn_gathered_outputs import warn_gathered_outputs

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph the passes may edit (the captured graph serves another planning, or a variant)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return compat.graph_module(gm, graph)


LOWER: list[Pass] = [
    fold_eager_attention,  # softmax(q @ k^T * scale + mask) @ v (transformers' eager attention) -> the attention op
    recognize_causal_masks,  # an attention mask computed from sizes alone that is causal -> is_causal=True
    fold_repeated_kv,     # repeat_kv(k), repeat_kv(v) into attention without a mask -> enable_gqa=True
    cast_to_compute_dtype,  # mixed precision: parameters (and inputs) enter in param_dtype
    lower_to_aten,        # Dynamo graph -> ATen graph on FakeTensors (global shapes)
    split_fused_projections,  # c_attn(x).split(C) -> one matmul per block of the fused weight
    split_fused_experts,  # MoE: gate_up_proj's expert matmul -> one per block (gate, up)
    exact_mean_losses,    # mean nll_loss -> its sum / its total weight (exact over split rows: padding)
]
PLACE: list[Pass] = [
    assign_placements,    # the policy places parameters, buffers and inputs
]
PROPAGATE: list[Pass] = [
    propagate_sharding,   # every node's placement, the collectives the plan costs, fallbacks
]
REWRITE: list[Pass] = [
    warn_gathered_outputs,  # outputs split in the unit that every step gathers whole (logits, KV cache)
    insert_collectives,   # -> the per-rank program: local tensors in and out, DTensor in between
    tag_recompute,        # recompute_modules: partitioner recompute tags (after the collectives exist,
                          # so that dynshard's own communication stays saved, never recomputed)
    outline_repeated_blocks,  # regional compilation: each repeated block becomes a call of one subgraph
]
PHASES: dict[str, list[Pass]] = {"lower": LOWER, "place": PLACE, "propagate": PROPAGATE, "rewrite": REWRITE}

log = logging.getLogger("dynshard")
graphs_log = logging.getLogger("dynshard.passes")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[Pass]) -> fx.GraphModule:
    """``passes`` in order (a phase), each timed into ``ctx.timings`` and logged."""
    for graph_pass in passes:
        start = time.perf_counter()
        gm = graph_pass(gm, ctx)
        elapsed = time.perf_counter() - start
        ctx.timings.append((graph_pass.__name__, elapsed))
        log.debug("pass %s: %.3fs, %d nodes", graph_pass.__name__, elapsed, len(gm.graph.nodes))
        _dump(graph_pass.__name__, gm)
    return gm



def _dump(name: str, gm: fx.GraphModule) -> None:
    if graphs_log.isEnabledFor(logging.DEBUG):
        graphs_log.debug("graph after %s:\n%s", name, gm.print_readable(print_output=False))
    compat.trace_artifact(f"dynshard_after_{name}", lambda: gm.print_readable(print_output=False))


__all__ = ["LOWER", "PLACE", "PROPAGATE", "REWRITE", "PHASES", "PassContext", "run_passes", "fold_eager_attention", "recognize_causal_masks", "fold_repeated_kv",
           "cast_to_compute_dtype", "lower_to_aten", "assign_placements",
           "propagate_sharding", "insert_collectives", "split_fused_projections", "tag_recompute",
           "outline_repeated_blocks", "exact_mean_losses", "warn_gathered_outputs", "split_fused_experts"]
