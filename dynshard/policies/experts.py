"""Expert tensor parallelism for the ``tp`` policy: the 3-D expert weights of mixture-of-experts layers.

transformers keeps a layer's experts as two stacked parameters, ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], run over the routed tokens by one static-shape graph (``experts_implementation=
"batched_mm"``: the weights indexed by each token's expert, then ``bmm``; ``"grouped_mm"``: the tokens
sorted by expert, then a grouped matmul). Megatron's expert tensor parallelism splits every expert's
intermediate dimension I, as its MLP: the first weight column-parallel (``gate_up_proj`` along dim 1, block
by block: gate and up are cut apart by :mod:`..passes.split_fused_experts`, so it is stored as
``_StridedShard(1, split_factor=2)``), the second row-parallel (``down_proj`` along dim 2). Routing stays
whole on every rank (the router is small and its top-k needs every expert's logit); each rank runs its
I/t columns of every routed expert, and the layer's output is a partial sum, all-reduced once where it
is produced. Per MoE layer: 1 all-reduce forward (of the [tokens x top_k, H] expert outputs, before
the weighted sum over top-k) and 1 backward (the experts' input gradient), no data-dependent
communication.

The weights are found from the graph, like Megatron's pairs: a 3-D parameter read (through its blocks,
dtype casts, transposes and an index by expert ids along dim 0) only by expert matmuls. The first
weights of the pairs (whose matmuls read a whole activation) are tried column-split, in graph order; a
split stands when it adds at most one all-reduce. Then the weights that read a split activation are
tried row-split; they stand when communication does not grow.

``experts_implementation="eager"`` (transformers' loop over the experts that tokens hit: ``nonzero``,
then a Python loop with one graph break per expert) is refused: see :func:`refuse_eager_experts`.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch.distributed.tensor import Replicate

from ..passes.op_sets import CASTS, TRANSPOSE_OPS, aten
from ..passes.propagation import Propagation
from ..passes.split_fused_experts import expert_matmuls
from ..passes.split_fused_projections import param_block
from ..runtime.sharding import SHARDS
from .plan_builder import PlanBuilder, PlanError
from .trials import adds_only_all_reduces, try_propagate

# weight operand position -> (its dimension the output keeps, its dimension the matmul contracts), for
# the weight as the matmul reads it: bmm's first operand [S, M, K], the grouped matmuls' second [E, K, N]
_WEIGHT_DIMS = {0: (1, 2), 1: (2, 1)}


@dataclasses.dataclass
class ExpertWeight:
    name: str
    out_dim: int            # the parameter's dimension the matmul's output keeps (column split)
    contracted_dim: int     # the parameter's dimension the matmul contracts (row split)
    activations: list[fx.Node]   # the other operands of its matmuls


def split_experts(plan: PlanBuilder, base: Propagation) -> Propagation:
    """Split the experts' 3-D weights (column- then row-parallel); the propagation of what stands."""
    refuse_eager_experts(plan)
    weights = expert_weights(plan)
    if not weights or plan.tp_size == 1:
        return base
    rows = []
    for weight in weights:          # column pass, in graph order
        if plan.is_fixed(weight.name):
            continue
        if any(_is_split(base, a) for a in weight.activations):
            rows.append(weight)     # it reads a split activation: a row-split candidate
            continue
        if not _divides(plan, weight.name, weight.out_dim):
            continue
        plan.shard(weight.name, weight.out_dim)
        trial = try_propagate(plan, base)
        if trial is not None and adds_only_all_reduces(base, trial):
            base = trial
        else:
            plan.replicate(weight.name)
    # the row pass: weights first seen replicated may read a split activation now
    rows += [w for w in weights if w not in rows and not plan.is_fixed(w.name)
             and plan.placement(w.name) == Replicate() and any(_is_split(base, a) for a in w.activations)]
    targets = [(w.name, w.contracted_dim) for w in rows if _divides(plan, w.name, w.contracted_dim)]
    if targets:
        accepted = _accept_rows(plan, base, targets)
        if accepted is None:
            for target in targets:
                base = _accept_rows(plan, base, [target]) or base
        else:
            base = accepted
    return base


def expert_weights(plan: PlanBuilder) -> list[ExpertWeight]:
    """The 3-D parameters read only by expert matmuls, each with one output and one contracted
    dimension, in the order of their first matmul in the graph."""
    matmuls = expert_matmuls()
    order = {node: i for i, node in enumerate(plan.graph.nodes)}
    found = []
    for name, inp in plan.state.items():
        if inp.kind != "parameter" or len(inp.shape) != 3:
            continue
        uses = _expert_uses(plan.node_of(name), matmuls)
        dims = {(out, contracted) for _, _, out, contracted in uses}
        if not uses or len(dims) != 1:
            continue
        out_dim, contracted_dim = dims.pop()
        activations = [m.args[1 - position] for m, position, _, _ in uses]
        first = min(order[m] for m, _, _, _ in uses)
        found.append((first, ExpertWeight(name, out_dim, contracted_dim, activations)))
    return [weight for _, weight in sorted(found, key=lambda item: item[0])]


def _expert_uses(param: fx.Node, matmuls: dict) -> list[tuple[fx.Node, int, int, int]]:
    """(matmul, weight operand position, parameter dim kept, parameter dim contracted) for each use, or
    [] if any use is not an expert matmul reached through blocks, casts, transposes and an expert index."""
    uses = []
    stack = [(param, (0, 1, 2))]      # node, and where each parameter dimension is in it
    while stack:
        node, dims = stack.pop()
        for user in node.users:
            if user.target is param_block or user.target in CASTS:
                stack.append((user, dims))
            elif user.target in TRANSPOSE_OPS and len(dims) == 3:
                stack.append((user, _transposed(user, dims)))
            elif user.target is aten.index.Tensor and user.args[0] is node and len(user.args[1]) == 1:
                stack.append((user, dims))          # [E, A, B][ids] -> [S, A, B]
            elif user.target in matmuls and matmuls[user.target][0] < len(user.args) \
                    and user.args[matmuls[user.target][0]] is node:
                position = matmuls[user.target][0]
                kept, contracted = _WEIGHT_DIMS[position]
                if dims.index(kept) == 0 or dims.index(contracted) == 0:
                    return []
                uses.append((user, position, dims.index(kept), dims.index(contracted)))
            else:
                return []
    return uses


def _transposed(node: fx.Node, dims: tuple[int, ...]) -> tuple[int, ...]:
    """Where each parameter dimension is after ``node`` (a transpose or permute of a 3-D value)."""
    if node.target is aten.permute.default:
        perm = [p % 3 for p in node.args[1]]
        return tuple(perm.index(d) for d in dims)
    if node.target is aten.t.default:
        return dims
    a, b = node.args[1] % 3, node.args[2] % 3
    return tuple(b if d == a else a if d == b else d for d in dims)


def _divides(plan: PlanBuilder, name: str, dim: int) -> bool:
    """``dim`` divides by the unit's size in every block of the parameter."""
    inp = plan.state[name]
    blocks, block_dim = plan.ctx.blocked.get(inp.index, (1, None))
    size = inp.shape[dim] // (blocks if dim == block_dim else 1)
    return plan.divides(name, dim) and size % plan.tp_size == 0


def _accept_rows(plan: PlanBuilder, base: Propagation, targets) -> Propagation | None:
    for name, dim in targets:
        plan.shard(name, dim)
    trial = try_propagate(plan, base)
    if trial is not None and trial.comm_bytes() <= base.comm_bytes() and _kinds(trial) <= _kinds(base):
        return trial
    for name, _ in targets:
        plan.replicate(name)
    return None


def _kinds(propagation: Propagation) -> set[str]:
    return {c.kind for c in propagation.collectives}


def _is_split(propagation: Propagation, node) -> bool:
    placements = propagation.placements.get(node.name, ()) if isinstance(node, fx.Node) else ()
    return any(isinstance(p, SHARDS) for p in placements)


# -- the eager loop -----------------------------------------------------------------------------------

def refuse_eager_experts(plan: PlanBuilder) -> None:
    """transformers' eager experts (``experts_implementation="eager"``) cannot be planned: ``nonzero``
    breaks Dynamo's graph and the loop over the experts that tokens hit runs in Python, each expert on a
    data-dependent number of tokens. The expert weights never enter a compiled graph (so nothing splits
    them, and their gradients are never averaged over data-parallel units), and each new token count
    compiles a new static-shape plan of what Dynamo does capture there. Raised on the first compile of a
    frame whose modules hold such experts, before anything runs."""
    if plan.tp_size == 1:
        return
    from ..runtime.materialize import frame_roots

    for root in frame_roots():
        for path, module in root.named_modules():
            config = getattr(module, "config", None)
            implementation = getattr(config, "_experts_implementation", None)
            if implementation == "eager" and hasattr(module, "has_gate") \
                    and any(p.dim() == 3 for p in module.parameters(recurse=False)):
                raise PlanError(
                    f"dynshard: the experts at {path or type(module).__name__} ({type(module).__name__}) run "
                    "transformers' eager loop over the experts (nonzero, then one graph break per expert hit, "
                    "on a data-dependent number of tokens): the tp policy cannot split them, and they would "
                    "run whole and uncompiled on every rank, with their gradients not averaged over "
                    "data-parallel units. Load the model with experts_implementation=\"batched_mm\" "
                    "(from_pretrained(..., experts_implementation=\"batched_mm\"), or "
                    "model.set_experts_implementation(\"batched_mm\") before torch.compile; \"grouped_mm\" "
                    "works too): one static-shape graph whose experts tp splits along their intermediate "
                    "dimension")
