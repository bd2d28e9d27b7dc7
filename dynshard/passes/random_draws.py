"""Random ops on split values draw the one process's values: each rank draws the whole tensor and keeps its
shard.

DTensor runs a random op on each rank's local shard. Without its RNG tracker (CPU meshes have none) every
rank then draws from the same generator state, so the shards get the *same* numbers: attention dropout
on heads split over two ranks drops the same positions in head ``h`` and head ``h + H/2``, and a batch split
(``data``, ``batch_parallel``) gives every rank's rows one mask. Nothing fails; the noise is not the one
process's (correlated where it should be independent).

dynshard instead draws a random op whose values depend only on its shape (``bernoulli_``, ``rand_like``,
``uniform_``, ...) on an empty tensor of the *global* shape on every rank, replicated, and keeps this rank's
shard: a local slice, no communication. The ranks of a plan unit draw from one generator state (checked:
:mod:`dynshard.runtime.unit_inputs`), so each shard holds exactly the values the one process draws there.
Inductor generates a random number from its element's index, so the slice is computed alone (the whole
draw is never materialised); under ``aot_eager`` the whole draw exists for a moment.

A random op whose values also depend on its input's values (``bernoulli(probabilities)``,
``native_dropout``) is a replicated fallback instead: its inputs are gathered and it runs whole, exact at
the price of the gather. Attention kernels with ``dropout_p`` are left to DTensor (on CUDA its
offset-based RNG tracker gives each shard its own part of the one stream).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import compat
from ..compat import pytree

aten = torch.ops.aten

# random ops whose result depends on their first argument's shape, dtype and device only
DRAWN_BY_SHAPE = {
    aten.bernoulli.p, aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default,
    aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
    aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.rand_like.default,
    aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
}


@functools.cache          # (asked for every op of every propagation)
def is_random(target) -> bool:
    """An op that draws random numbers (attention kernels, which carry the tag for their dropout, excepted)."""
    return isinstance(target, compat.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags and \
        not any(a.name == "dropout_p" for a in target._schema.arguments)


def on_split_values(args, kwargs) -> bool:
    """Whether a random op's first DTensor operand is split (else it is drawn whole already)."""
    first = next((a for a in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(a, DTensor)), None)
    return first is not None and any(p != Replicate() for p in first.placements)


def draw_whole_fn(target, mesh):
    """``target`` on the global shape of its split first operand, on every rank; this rank's shard of the
    result, placed as that operand is. An in-place op fills the operand's shard with it, as it would have."""
    in_place = target._schema.is_mutable

    def draw_whole(operand: DTensor, *args, **kwargs):
        whole = torch.empty(operand.shape, dtype=operand.dtype, device=operand.to_local().device)
        drawn = target(whole, *args, **kwargs)
        replicated = DTensor.from_local(drawn, mesh, [Replicate()] * mesh.ndim, run_check=False)
        shard = replicated.redistribute(mesh, operand.placements)
        if in_place:
            operand.to_local().copy_(shard.to_local())
            return operand
        return shard
    draw_whole.draws_random = True      # (tag_recompute: saved, never recomputed)
    return draw_whole
