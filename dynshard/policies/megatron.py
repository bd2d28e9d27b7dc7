"""The ``tp`` policy: Megatron-style tensor parallelism, found from the graph (not from module names).

1. Column pass: 2-D parameters used only as matmul operands are tried, in graph order, split along
   their output (non-contracted) dimension; matmuls that read the same activation (q, k and v of one
   attention) are tried together, since none of them can be split alone. The split stands when sharding
   propagation shows it adds no collective except at most one all-reduce: the column-split output then
   flows (through GELU, through the head reshape of attention, ...) to a matmul that contracts over the
   split dimension and leaves a partial sum, reduced once. A split that would need an all-gather (e.g.
   an LM head before a softmax over the vocabulary) is undone. A group that is undone is tried member by
   member: with one k/v head (multi-query attention) q alone stands, and propagation slices the repeated
   k/v locally like q's heads (:class:`~..passes.propagate_sharding.MatchedSlice`).
2. Row pass: a replicated parameter that DTensor re-shards locally before use (the second matmul of a
   pair, the bias of a column-split linear) is stored in that split instead, which keeps its gradient
   local. It stands when the plan's communication does not grow.

3. Vocabulary pass: the largest embedding table indexed by token ids is split along its rows
   (Megatron's VocabParallelEmbedding: a masked lookup, then one all-reduce per lookup; T5's shared
   table is looked up twice, by the encoder and the decoder, and read a third time by the tied head).
   An LM head that is not tied is split along the vocabulary by the column pass, since the cross-entropy
   over split logits adds only all-reduces of one value per row (:mod:`..passes.vocab_parallel_loss`).

The row pass also stores a table looked up with positions (T5's relative attention bias, ``[buckets,
heads]``) split along its embedding dimension when its lookup is re-sharded locally by heads on the way
to the attention scores: each rank looks up its heads' columns and the table's gradient stays local.

On a transformer layer this yields q/k/v and fc1 column-split, the attention output projection and fc2
row-split, attention split by heads: 2 all-reduces forward and 2 backward, Megatron's minimum.

4. Sequence parallelism (``pas_config={"sequence_parallel": True}``, Megatron's): every partial sum the
   plan reduces (row-split outputs, the vocab-parallel embedding) is reduce-scattered along its sequence
   dimension (-2: T of [B, T, C]) instead, and every activation read by matmuls is gathered there. Norms,
   dropouts and residual adds between them run on 1/t of the tokens; per layer 2 all-gathers and 2
   reduce-scatters forward and backward, the bytes of the 4 all-reduces they replace.

5. Batch parallelism (``pas_config={"batch_parallel": True}``): the same, along the batch (dimension 0)
   instead of the sequence. With layers pinned whole it is data parallelism inside the unit for those
   layers and tp for the rest: a pinned attention reads the norm's batch shard and runs on its rows (its
   weights replicated, their gradients all-reduced over the unit), and the split MLP gathers its input and
   reduce-scatters its output over the batch. Attention mixes tokens along the sequence, not the batch, so a
   whole layer needs no gather, where along the sequence it would.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard

from ..compat import OpOverload
from ..config import Config, ConfigError
from ..config.errors import check_option_names
from ..passes.insert_collectives import matmul_input_roots
from ..passes.op_sets import CASTS, MATMUL_OPERANDS, SLICE_COMMUTING, TRANSPOSE_OPS, VIEW_OPS, aten, view_root
from ..passes.propagation import Propagation
from ..passes.split_fused_projections import param_block
from ..runtime.sharding import SHARDS
from .context_parallel import split_sequence
from .experts import split_experts
from .plan_builder import PlanBuilder
from .repeated_layers import TiedDecisions
from .trials import adds_only_all_reduces, try_propagate


@dataclasses.dataclass(frozen=True)
class TensorParallelOptions:
    """The ``tp`` policy's ``pas_config``."""

    sequence_parallel: bool = False
    batch_parallel: bool = False
    context_parallel: int = 1       # ranks of the unit that split the sequence (context_parallel.py)

    @classmethod
    def from_pas_config(cls, pas_config: Mapping[str, Any]) -> "TensorParallelOptions":
        check_option_names(cls, pas_config, "the tp policy")
        for name, value in pas_config.items():
            if name == "context_parallel":
                if type(value) is not int or value < 1:
                    raise ConfigError(f"dynshard: pas_config['context_parallel'] must be a positive integer (the "
                                      f"ranks that split the sequence), got {value!r}")
            elif not isinstance(value, bool):
                raise ConfigError(f"dynshard: pas_config[{name!r}] must be True or False, got {value!r}")
        options = cls(**pas_config)
        if options.sequence_parallel and options.batch_parallel:
            raise ConfigError("dynshard: pas_config sets both sequence_parallel and batch_parallel: the activations "
                              "between split layers are split along one dimension; choose one")
        if options.context_parallel > 1 and (options.sequence_parallel or options.batch_parallel):
            raise ConfigError("dynshard: context_parallel splits every activation along the sequence already; "
                              "leave sequence_parallel and batch_parallel unset")
        return options

    def check_unit(self, plan_ngpus: int) -> None:
        if self.context_parallel > 1 and self.context_parallel != plan_ngpus:
            raise ConfigError(
                f"dynshard: context_parallel={self.context_parallel} with plan_ngpus={plan_ngpus}: context "
                "parallelism splits the whole unit for now (tensor parallelism beside it, a 2-D unit, is not "
                f"built yet); set plan_ngpus={self.context_parallel}")

    @property
    def split_dim(self) -> int | None:
        """The dimension the activations between split layers are split along (-2: the sequence; None: whole)."""
        return -2 if self.sequence_parallel else 0 if self.batch_parallel else None


def tp(plan: PlanBuilder, config: Config) -> None:
    options = TensorParallelOptions.from_pas_config(config.pas_config)
    options.check_unit(config.plan_ngpus)
    if options.context_parallel > 1:
        split_sequence(plan, options.context_parallel)
        return
    tensor_parallel_layers(plan, options)


def tensor_parallel_layers(plan: PlanBuilder, options: TensorParallelOptions) -> None:
    """Megatron's placements with ``options`` (the tp policy's, or a hybrid pipeline stage's)."""
    base = _split_columns(plan, plan.propagate())
    base = split_experts(plan, base)      # mixture of experts: 3-D expert weights, column then row
    base = _split_vocabulary(plan, base)
    base = _store_local_reshards(plan, base)
    if options.split_dim is not None:
        _split_activations(plan, base, options.split_dim)


def _split_columns(plan: PlanBuilder, base: Propagation) -> Propagation:
    """The column pass, a trial per group; a repeated layer's groups take the decision of their first two
    occurrences (:mod:`.repeated_layers`), checked together before the next trial."""
    decisions = TiedDecisions()
    for activation, group in column_groups(plan):
        group = [(name, dim) for name, dim in group if not plan.is_fixed(name) and plan.divides(name, dim)]
        if not group:
            continue
        tied = decisions.decision(group)
        if tied is not None:
            for name, dim in tied:
                plan.shard(name, dim)
            if tied:
                decisions.tied.append(tied)
            continue
        base = _settle_tied(plan, base, decisions)
        if _is_split(base, activation):
            decisions.record(group, [])
            continue      # a matmul reading a split activation is a row-split candidate (second pass)
        accepted = _try_column_split(plan, base, group)
        split = group if accepted is not None else []
        if accepted is None and len(group) > 1:
            # one member alone: the queries of multi-query attention, whose one k/v head cannot be
            # split (the trial of q, k and v splits k's and v's head dimension instead); propagation
            # then slices the repeated k/v like q's heads at the attention matmuls
            for member in group:
                trial = _try_column_split(plan, base, [member])
                if trial is not None:
                    base, split = trial, split + [member]
        else:
            base = accepted or base
        decisions.record(group, split)
    return _settle_tied(plan, base, decisions)


def _settle_tied(plan: PlanBuilder, base: Propagation, decisions: TiedDecisions) -> Propagation:
    """``base`` with the tied splits made since it was propagated: one propagation, held to the rule every
    trial meets (at most one added all-reduce a group); when it fails, each group is tried as before."""
    pending, decisions.tied = decisions.tied, []
    if not pending:
        return base
    settled = try_propagate(plan, base)
    if settled is not None and adds_only_all_reduces(base, settled, at_most=len(pending)):
        return settled
    for group in pending:
        for name, _ in group:
            plan.replicate(name)
    for group in pending:
        base = _try_column_split(plan, base, group) or base
    return base


def _try_column_split(plan: PlanBuilder, base: Propagation, group: list[tuple[str, int]]) -> Propagation | None:
    """Split ``group`` along its output dimensions; kept (and its propagation returned) when that adds
    at most one all-reduce, undone otherwise (None)."""
    for name, out_dim in group:
        plan.shard(name, out_dim)
    trial = try_propagate(plan, base)
    if trial is not None and adds_only_all_reduces(base, trial):
        return trial
    for name, _ in group:
        plan.replicate(name)
    return None


def _split_activations(plan: PlanBuilder, base: Propagation, dim: int) -> None:
    for node, placement, readers in sequence_parallel_activations(plan.graph, base, plan.tp_size, dim):
        plan.place_activation(node, placement, readers=readers)


def sequence_parallel_activations(graph: fx.Graph, base: Propagation, tp_size: int, dim: int = -2
                                  ) -> list[tuple[fx.Node, Placement, list[fx.Node] | None]]:
    """Megatron's sequence parallelism on the tp placements propagated as ``base``: each partial sum it reduces
    is reduce-scattered along the sequence (``dim`` -2; 0: the batch) instead, and gathered again before the
    matmuls that read it. Each activation's placement and its readers (None: every reader), in graph order
    (plans print the same on every run)."""
    roots = set(matmul_input_roots(graph, base))
    placed = []
    for node in graph.nodes:
        value = node.meta.get("val")
        if node in roots:      # gathered for its matmuls only; a residual add that reads it stays split
            # (along the batch, only where a matmul of a split weight reads it: a layer left whole runs on the
            # shard; but a whole projection beside a split one reads it gathered too, as under tp: the one k/v
            # head of multi-query attention, which the attention matmuls slice like q's heads)
            readers = _matmul_readers(node) if dim == -2 or _matmul_readers(node, base) else []
            if readers:
                placed.append((node, Replicate(), readers))
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[dim] % tp_size == 0 and (
                node.name in base.reduced_partials or dim == 0 and _whole_token_lookup(node, base)):
            placed.append((node, Shard(dim % value.dim()), None))
    return placed


def _whole_token_lookup(node: fx.Node, base: Propagation) -> bool:
    """A lookup of a whole table with indices from an input (token ids, [B, T]): along the batch its output is
    split where it is made (a local slice), so the layers after it run on the batch shard from the start."""
    return node.target == aten.embedding.default and view_root(node.args[1]).op == "placeholder" and all(
        p == Replicate() for p in base.placements.get(node.name, (Shard(0),)))


def _split_vocabulary(plan: PlanBuilder, base: Propagation) -> Propagation:
    """Megatron's VocabParallelEmbedding: the token embedding split along its rows (a masked lookup
    and one all-reduce of its partial output per lookup). A table the LM head shares (tied) is split once
    for both; the head's logits then stay split into the vocab-parallel cross-entropy. A table shared by
    an encoder and a decoder (T5) is looked up twice: two all-reduces, one for each lookup."""
    for name in token_embeddings(plan):
        if plan.is_fixed(name) or not plan.divides(name, 0) or _is_split(base, plan.node_of(name)):
            continue
        plan.shard(name, 0)
        trial = try_propagate(plan, base)
        if trial is not None and adds_only_all_reduces(base, trial, at_most=len(_lookups(plan, name))):
            base = trial
        else:
            plan.replicate(name)
    return base


def _lookups(plan: PlanBuilder, name: str) -> list[fx.Node]:
    """The ``embedding`` nodes that look ``name`` up (directly or through its casts)."""
    return [u for use in _through_casts(plan.node_of(name)) for u in use.users
            if u.target == aten.embedding.default and u.args[0] is use]


def token_embeddings(plan: PlanBuilder) -> list[str]:
    """The largest embedding tables looked up with indices from a user input (token ids; position
    tables are indexed by ``arange``, and small type tables are not worth an all-reduce)."""
    user = set(_user_placeholders(plan))
    sizes = {}
    for name, inp in plan.state.items():
        if inp.kind != "parameter" or len(inp.shape) != 2:
            continue
        lookups = _lookups(plan, name)
        if lookups and any(view_root(u.args[1]) in user for u in lookups):
            sizes[name] = inp.shape[0]
    largest = max(sizes.values(), default=0)
    return [name for name, rows in sizes.items() if rows == largest]


def _through_casts(node: fx.Node) -> list[fx.Node]:
    """``node`` and its dtype casts (mixed precision)."""
    return [node] + [u for u in node.users if u.target in CASTS]


def _user_placeholders(plan: PlanBuilder) -> list[fx.Node]:
    placeholders = [n for n in plan.graph.nodes if n.op == "placeholder"]
    return [placeholders[inp.index] for inp in plan.user_inputs]


def column_groups(plan: PlanBuilder) -> list[tuple[fx.Node | None, list[tuple[str, int]]]]:
    """2-D parameters whose every use is as a matmul operand, with the dimension not contracted,
    grouped by the activation their matmuls read (None for a parameter used by several matmuls), in
    graph order."""
    order = {node: i for i, node in enumerate(plan.graph.nodes)}
    groups: dict[fx.Node | None, list[tuple[int, str, int]]] = {}
    for name, inp in plan.state.items():
        if inp.kind != "parameter" or len(inp.shape) != 2:
            continue
        uses = _matmul_uses(plan.node_of(name))
        out_dims = {_output_dim(use) for use in uses}
        if not uses or len(out_dims) != 1 or None in out_dims:
            continue
        matmul, _, _ = uses[0]
        activations = {view_root(m.args[MATMUL_OPERANDS[m.target] + (1 - position)]) for m, position, _ in uses}
        key = activations.pop() if len(activations) == 1 else matmul
        groups.setdefault(key, []).append((order[matmul], name, out_dims.pop()))
    ordered = sorted(groups.items(), key=lambda item: min(m[0] for m in item[1]))
    return [(key if key.target not in MATMUL_OPERANDS else None, [(name, dim) for _, name, dim in sorted(members)])
            for key, members in ordered]


def _is_split(propagation: Propagation, node: fx.Node | None) -> bool:
    placements = propagation.placements.get(node.name, ()) if isinstance(node, fx.Node) else ()
    return any(isinstance(p, SHARDS) for p in placements)


def _matmul_uses(param: fx.Node):
    """(matmul node, operand position, dimension map param->operand) for each use, or [] if any use is
    not a matmul reached through transposes."""
    uses = []
    stack = [(param, (0, 1))]
    while stack:
        node, dims = stack.pop()
        for user in node.users:
            if user.target in TRANSPOSE_OPS:
                stack.append((user, _transpose_map(user, dims)))
            elif user.target is param_block or user.target in CASTS:   # mixed precision casts parameters
                stack.append((user, dims))
            elif user.target in MATMUL_OPERANDS and node in user.args[MATMUL_OPERANDS[user.target]:][:2]:
                position = user.args.index(node) - MATMUL_OPERANDS[user.target]
                uses.append((user, position, dims))
            else:
                return []
    return uses


def _transpose_map(node: fx.Node, dims: tuple[int, int]) -> tuple[int, int]:
    """After a transpose, which operand dimension each parameter dimension has moved to."""
    if node.target == aten.permute.default:
        perm = list(node.args[1])
        return tuple(perm.index(d) for d in dims)
    return (dims[1], dims[0])


def _output_dim(use) -> int | None:
    """The parameter dimension that a matmul does not contract (it survives into the output)."""
    _, position, dims = use
    contracted = 1 if position == 0 else 0   # mm(a, b): a's dim 1 and b's dim 0 are contracted
    for param_dim, operand_dim in enumerate(dims):
        if operand_dim != contracted:
            return param_dim
    return None


def _matmul_readers(node: fx.Node, split: Propagation | None = None) -> list[fx.Node]:
    """The nodes reading ``node`` through which it reaches a matmul operand (directly or by views); with a
    propagation ``split``, only matmuls whose other operand it splits."""
    def reaches_matmul(user: fx.Node) -> bool:
        if user.target in MATMUL_OPERANDS:
            first = MATMUL_OPERANDS[user.target]
            return split is None or any(isinstance(p, SHARDS) for operand in user.args[first:first + 2]
                                        if isinstance(operand, fx.Node)
                                        for p in split.placements.get(operand.name, ()))
        return user.target in VIEW_OPS and any(reaches_matmul(u) for u in user.users)
    return [user for user in node.users if reaches_matmul(user)]


def _store_local_reshards(plan: PlanBuilder, base: Propagation) -> Propagation:
    """All candidates are tried at once first (the usual case: every one of them stands), and one by
    one only if that trial fails."""
    nodes = {node.name: node for node in plan.graph.nodes}
    targets = []
    for reshard in base.local_reshards:
        source = nodes.get(reshard.source)
        target = _parameter_dim(plan, source, reshard.dst) or _looked_up_dim(plan, source, reshard.dst)
        if target is not None and target not in targets and not plan.is_fixed(target[0]) \
                and plan.divides(*target):
            targets.append(target)
    if not targets:
        return base
    accepted = _accept_shards(plan, base, targets)
    if accepted is not None:
        return accepted
    for target in targets:
        base = _accept_shards(plan, base, [target]) or base
    return base


def _accept_shards(plan: PlanBuilder, base: Propagation, targets) -> Propagation | None:
    for name, dim in targets:
        plan.shard(name, dim)
    trial = try_propagate(plan, base)
    if trial is not None and trial.comm_bytes() <= base.comm_bytes() \
            and len(trial.local_reshards) <= len(base.local_reshards) - len(targets):
        return trial
    for name, _ in targets:
        plan.replicate(name)
    return None


def _parameter_dim(plan: PlanBuilder, node: fx.Node | None, dst) -> tuple[str, int] | None:
    """Follow transposes back from a re-sharded value to the parameter it views."""
    if node is None or not dst:
        return None
    placement = dst[0]
    if type(placement) is not Shard:
        return None
    dim = placement.dim
    while node.op == "call_function":
        two_dims = node.target == aten.transpose.int and len(node.args[0].meta["val"].shape) == 2
        if node.target == aten.t.default or two_dims:
            dim = 1 - dim
        elif node.target == aten.permute.default:
            dim = list(node.args[1])[dim]
        elif node.target is not param_block and node.target not in CASTS:
            return None
        node = node.args[0]
    inp = plan.input_of(node)
    if inp is None or inp.kind != "parameter" or inp.tag is not None:
        return None
    return inp.name, dim


def _looked_up_dim(plan: PlanBuilder, node: fx.Node | None, dst) -> tuple[str, int] | None:
    """Follow a re-sharded value back to the table it was looked up in, when the split dimension is the
    table's embedding dimension: (table, 1). T5's relative attention bias looks up ``[T, T, heads]``,
    permutes it to ``[1, heads, T, T]`` (the decoder adds its causal mask) and adds it to the scores split
    by heads; its table split along the heads is looked up locally and its gradient stays local. The way
    back goes through casts, copies, ``unsqueeze``, ``permute`` and pointwise ops where exactly one
    operand carries the split dimension (the others broadcast along it)."""
    if node is None or not dst or type(dst[0]) is not Shard or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    dim = dst[0].dim % node.meta["val"].dim()
    while node.op == "call_function":
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return None
        if node.target == aten.embedding.default:
            if dim != value.dim() - 1:
                return None
            table = node.args[0]
            while isinstance(table, fx.Node) and table.target in CASTS:
                table = table.args[0]
            inp = plan.input_of(table) if isinstance(table, fx.Node) else None
            ok = inp is not None and inp.kind == "parameter" and inp.tag is None and len(inp.shape) == 2
            return (inp.name, 1) if ok else None
        if node.target == aten.unsqueeze.default:
            inserted = node.args[1] % value.dim()
            if dim == inserted:
                return None
            dim -= dim > inserted
        elif node.target == aten.permute.default:
            dim = list(node.args[1])[dim] % value.dim()
        elif node.target in CASTS or node.target in SLICE_COMMUTING or _is_pointwise(node.target):
            carriers = [(a, a.meta["val"].dim() - value.dim() + dim) for a in node.args
                        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                        and 0 <= a.meta["val"].dim() - value.dim() + dim
                        and a.meta["val"].shape[a.meta["val"].dim() - value.dim() + dim] == value.shape[dim]]
            if len(carriers) != 1:
                return None
            node, dim = carriers[0]
            continue
        else:
            return None
        node = node.args[0]
    return None


def _is_pointwise(target) -> bool:
    return isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags
