"""Context parallelism, the ``tp`` policy's ``pas_config={"context_parallel": C}``: the sequence split over the
unit's ranks.

Every user input that carries the sequence (token ids, labels, masks, positions: ``[B, T, ...]``) is placed
split along its dimension 1, a local slice of the batch every rank of the unit holds. DTensor's strategies
then run each token-wise op on the rank's tokens (embeddings, norms, projections, the MLP, the loss over
padded targets, exact by :mod:`~..passes.exact_mean_losses`), slice whole operands they meet (positions made
in the program, rotary tables, shifted labels) the same way, and all-reduce the gradients of the parameters,
which stay whole. Attention, the one op that mixes tokens, gathers the keys and values
(:mod:`~..passes.context_parallel_attention`, its causal work balanced over the ranks).

Sizes: the sequence must split into ``2 C`` equal chunks under a causal mask (each rank computes two), into
``C`` without one; else an error that names the size, before anything runs. A graph run without gradients
(evaluation, ``generate``'s steps) whose sequence does not split runs whole on every rank of the unit
instead: it keeps nothing for a backward, and an evaluation set is seldom padded as training batches are.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..config import ConfigError
from ..passes.context_parallel_attention import ATTENTION_OPS, attention_arguments
from .plan_builder import PlanBuilder

SEQUENCE_DIM = 1        # of a user input: [B, T, ...]
log = logging.getLogger("dynshard")


def split_sequence(plan: PlanBuilder, ranks: int) -> None:
    """Place every user input that carries the sequence split along it over the unit's ``ranks``."""
    attention = [n for n in plan.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    length = sequence_length(plan, attention)
    causal = any(attention_arguments(n.target, n.args, n.kwargs).is_causal for n in attention)
    chunks = 2 * ranks if causal else ranks
    if length % chunks and not torch.is_grad_enabled():
        log.info("dynshard: context_parallel=%d: a sequence of %d tokens does not split into %d chunks; this graph "
                 "runs without gradients, so it runs whole on every rank of the unit", ranks, length, chunks)
        return
    if length % chunks:
        why = f"{chunks} chunks (two per rank: causal attention's work balanced)" if causal else f"{chunks} chunks"
        raise ConfigError(
            f"dynshard: context_parallel={ranks} splits the sequence into {why}, but the sequence has {length} "
            f"tokens; pad batches to a multiple of {chunks} tokens (a collator's pad_to_multiple_of={chunks}) "
            "with labels -100, or choose a context_parallel that divides it")
    for inp in plan.user_inputs:
        if len(inp.shape) > SEQUENCE_DIM and inp.shape[SEQUENCE_DIM] == length:
            plan.shard(inp.name, SEQUENCE_DIM)


def sequence_length(plan: PlanBuilder, attention: list[fx.Node]) -> int:
    """The sequence's length: the queries' (dimension 2 of ``(B, H, T, D)``) of the graph's attention, else
    dimension 1 of its token ids (its first integer input of two or more dimensions)."""
    lengths = {n.args[0].meta["val"].shape[2] for n in attention if isinstance(n.args[0], fx.Node)}
    if len(lengths) > 1:
        raise ConfigError(f"dynshard: context_parallel splits one sequence; this graph attends over sequences "
                          f"of {sorted(lengths)} tokens")
    if lengths:
        return int(next(iter(lengths)))
    for inp in plan.user_inputs:
        if not inp.dtype.is_floating_point and inp.dtype != torch.bool and len(inp.shape) > SEQUENCE_DIM:
            return int(inp.shape[SEQUENCE_DIM])
    raise ConfigError("dynshard: context_parallel splits the sequence, but this graph has neither an attention "
                      "op (F.scaled_dot_product_attention) nor token ids ([batch, sequence] integers) to find it by")
