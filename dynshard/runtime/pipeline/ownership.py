"""Which rank holds what under a pipeline policy, and the once-per-step gradient reduction.

A rank holds the parameters and buffers of its own stages only: the others become empty tensors in
place (the same ``nn.Parameter`` objects, tagged with :class:`~dynshard.runtime.sharding.StageOwnership`
and shown with their global shape while Dynamo traces, as tp shards are). Their ``.grad`` stays None, so
a plain optimizer over ``model.parameters()`` updates exactly this rank's stages.

A tensor read by two stages on different ranks (a tied embedding and LM head) is held by both; after
the backward its gradient is summed over the ranks holding it (one process group per such set, as
Megatron's embedding group), then averaged over the data-parallel units.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..accumulation import job_accumulation
from ..job import current_job
from ..materialize import MetaInitError, materialize
from ..sharding import (_SHARDED, ALIKE_ATTR, ShardTag, StageOwnership, get_tag, placements_for, set_tag,
                        stored_piece)
from ..zero import gather_rows, shard_rows, zero_groups, zero_spec
from .groups import PipelineGroups


@dataclasses.dataclass
class Ownership:
    """This rank's stage tensors (by graph input index) and the groups that sum shared gradients."""

    held: dict[int, torch.Tensor]                 # graph input index -> tensor this rank holds
    shared: list[tuple[dist.ProcessGroup, list[int]]]   # (owners' group, graph input indices) for ties
    # hybrid: held tensors the stage programs split over tp first, tagged with their owner afterwards
    pending: dict[int, StageOwnership] = dataclasses.field(default_factory=dict)
    ties_checked: bool = False
    zero: set[int] = dataclasses.field(default_factory=set)   # held tensors stored as ZeRO rows over dp
    # hybrid with ZeRO: (level, ngroups, reduce-scatter) for the rows settle() cuts from the tp shards
    pending_zero: tuple[int, int, bool] | None = None

    def with_replicas(self, mb_args: list[list], train: bool) -> list[list]:
        """The micro-batches' inputs with whole replicas of the ZeRO tensors, gathered once per step (the
        accumulation machinery's: their gradients are reduce-scattered into the rows at the flush)."""
        if not self.zero:
            return mb_args
        if train:
            accumulation = job_accumulation()
            replicas = {i: accumulation.replica(self.held[i]) for i in self.zero}
        else:      # forward only: whole values for this call, nothing to reduce afterwards
            replicas = {i: full_rows(self.held[i]) for i in self.zero}
        return [[replicas.get(i, value) for i, value in enumerate(args)] for args in mb_args]

    def gradient(self, index: int, zeros: bool = False) -> torch.Tensor | None:
        """The gradient this step accumulated for a held tensor (a ZeRO tensor's is its replica's). With
        ``zeros``, a trainable tensor that got none gets zeros: the copy of a stage that ran no micro-batch
        (a plain call runs one lane of chimera_direct) still takes part in the sum over its owners."""
        tensor = self.held[index]
        if index in self.zero:
            entry = job_accumulation().replicas.get(id(tensor))
            return entry[1].grad if entry is not None else None
        if tensor.grad is None and zeros and tensor.requires_grad:
            tensor.grad = torch.zeros_like(tensor)
        return tensor.grad

    def settle(self) -> None:
        """After the stage programs cut their tensors into tp shards: record the stages that hold them and,
        with ZeRO, store the trainable ones as ZeRO rows of their tp shards over the data-parallel ranks
        (the pp layout's; gathered once per step by :meth:`with_replicas`)."""
        for index, owner in self.pending.items():
            tensor = self.held[index]
            tag = get_tag(tensor)
            tag.owner = owner
            if self.pending_zero is None or not tensor.requires_grad:
                continue
            level, ngroups, reduce_scatter = self.pending_zero
            spec = zero_spec(level, tag.layout, ngroups, tensor.shape, reduce_scatter)
            if spec is None:
                continue
            split_already = tag.is_split        # (then in _SHARDED: a WeakSet compares tensors by ==)
            tag.zero = spec
            with torch.no_grad():
                tensor.data = shard_rows(tensor.data, spec, zero_groups(tag.layout, ngroups).rank).clone()
            if not split_already:
                _SHARDED.add(tensor)
            self.zero.add(index)
        self.pending.clear()


def take_ownership(args, plan) -> Ownership:
    """First call: every rank agrees on rank 0's values (one broadcast per tensor, unless a meta-built
    model initialised them alike), then frees what its stages do not read and tags everything."""
    groups: PipelineGroups = plan.groups
    readers: dict[int, list[int]] = {}
    for stage in plan.staged.stages:
        for index in stage.graph_inputs:
            readers.setdefault(index, []).append(stage.index)
    mine = set(plan.schedule.stages_of(groups.pp_rank))
    held, tie_sets, pending, zero = {}, {}, {}, set()
    choice = plan.plan.zero
    if choice.level and groups.dp_size > 1:
        zero_groups(groups.layout, choice.ngroups)    # collective: every rank, before any tensor
    for inp in plan.inputs:
        if not inp.is_state or inp.index not in readers:
            continue
        tensor = args[inp.index]
        stages = tuple(readers[inp.index])
        if any(plan.schedule.on_every_rank(s) for s in stages):
            held[inp.index] = _all_device_tensor(inp, tensor, stages, plan)
            continue
        owner_ranks = sorted({r for s in stages for r in plan.schedule.ranks_of(s)})
        owns = bool(mine & set(stages))
        if len(owner_ranks) > 1:
            tie_sets.setdefault(tuple(owner_ranks), []).append(inp.index)
        if get_tag(tensor) is not None:      # an earlier plan of the model (another batch shape) placed it
            get_tag(tensor).add_plan(plan)
            if get_tag(tensor).not_held and owns:
                raise RuntimeError(f"dynshard: {inp.name} is read by a stage of this rank in one plan of the model "
                                   "but not in another: the stages were cut differently; cut them at pipe_split() "
                                   "calls or pipeline_pivots")
            if owns:
                held[inp.index] = tensor
                if get_tag(tensor).zero is not None:
                    zero.add(inp.index)
            continue
        _agree_on_rank_0(tensor)
        owner = None if groups.pp_size == 1 else StageOwnership(
            stages=stages, src=groups.global_rank(owner_ranks[0]), group=groups.pp_group, held=owns)
        if owns:
            held[inp.index] = tensor
        if owns and groups.layout.tp_size > 1:
            pending[inp.index] = owner      # tagged once its stage's program has split it over tp
        else:
            # (the graph input's shape: a meta-built model's tensors of other ranks' stages are freed already)
            spec = zero_spec(choice.level, groups.layout, choice.ngroups, inp.shape,
                             choice.reduce_scatter) if owns and tensor.requires_grad else None
            tag = ShardTag(fqn=inp.name, global_shape=inp.shape, global_stride=tuple(inp.stride),
                           placements=placements_for(plan.layout, {}), layout=plan.layout, zero=spec, owner=owner)
            if tag.is_split:     # another stage's, or ZeRO rows of this one's
                with torch.no_grad():
                    tensor.data = stored_piece(tensor.data, tag).clone()
                _SHARDED.add(tensor)
            if spec is not None:
                zero.add(inp.index)
            set_tag(tensor, tag)
            tag.add_plan(plan)
    shared = []
    for owner_ranks, indices in sorted(tie_sets.items()):
        for unit in range(groups.dp_size):   # every rank creates every group, in the same order
            for tp_rank in range(groups.layout.tp_size):
                group = _group(tuple(groups.global_rank(r, unit, tp_rank) for r in owner_ranks))
                if (unit, tp_rank) == (groups.dp_rank, groups.layout.tp_rank) and groups.pp_rank in owner_ranks:
                    shared.append((group, [i for i in indices if i in held]))
    pending_zero = None
    if pending and choice.level and groups.dp_size > 1:
        pending_zero = (choice.level, choice.ngroups, choice.reduce_scatter)
    return Ownership(held, shared, pending, zero=zero, pending_zero=pending_zero)


def materialize_stages(models, args, plan) -> None:
    """A meta-built model's first call: every module initialised as on one process, one at a time (see
    :mod:`dynshard.runtime.materialize`); the tensors no stage of this rank reads are freed as soon as they
    are initialised, so a rank's peak is its stages' tensors plus one module's."""
    readers: dict[int, list[int]] = {}
    for stage in plan.staged.stages:
        for index in stage.graph_inputs:
            readers.setdefault(index, []).append(stage.index)
    mine = set(plan.schedule.stages_of(plan.groups.pp_rank))

    def keep_or_free(tensor: torch.Tensor, inp) -> None:
        if not mine & set(readers.get(inp.index, ())):
            with torch.no_grad():
                tensor.data = tensor.data.new_empty(0)     # another rank's stage: take_ownership tags it

    materialize(models, plan, args, cut=keep_or_free)
    for inp in plan.inputs:
        if inp.is_state and args[inp.index].is_meta:
            raise MetaInitError(f"dynshard: {inp.name} is still on the meta device after initialisation; build "
                                "the model under torch.device('meta') and compile the module itself")


def _all_device_tensor(inp, tensor: torch.Tensor, stages: tuple[int, ...], plan) -> torch.Tensor:
    """A tensor of 1f1b_plus's all-device stage: every rank holds it, and the stage's tensor-parallel program
    cuts it into its shards and tags it, as a plain tp plan does (no stage ownership, no tie)."""
    if len(stages) > 1:
        raise NotImplementedError(
            f"dynshard: {inp.name} is read by the all-device segment of 1f1b_plus and by pipeline stage(s) "
            f"{', '.join(str(s) for s in stages[1:])} (a tied embedding and LM head?); sharing a tensor between them "
            "is not built yet. Untie it, or use pipeline_scheduler '1f1b'")
    if get_tag(tensor) is not None:          # an earlier plan of the model placed it
        get_tag(tensor).add_plan(plan)
        return tensor
    _agree_on_rank_0(tensor)
    return tensor


def _agree_on_rank_0(tensor: torch.Tensor) -> None:
    """Every rank takes rank 0's values (unless a meta-built model initialised them alike); marked, so the
    stage programs that split it over tp need not broadcast again."""
    if dist.is_initialized() and not tensor.is_meta and not getattr(tensor, ALIKE_ATTR, False):
        with torch.no_grad():
            dist.broadcast(tensor.data, src=0)
    setattr(tensor, ALIKE_ATTR, True)


def full_rows(tensor: torch.Tensor) -> torch.Tensor:
    tag = get_tag(tensor)
    with torch.no_grad():
        return gather_rows(tensor.detach(), tag.zero, zero_groups(tag.layout, tag.zero.ngroups))


class _OwnersGroups(dict):
    """The groups of the ranks that own a tensor together, by ranks: a part of the job, whose groups they are."""


def _group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """One process group per set of ranks for the job (every plan of every model shares it)."""
    groups = current_job().part(_OwnersGroups)
    if ranks not in groups:
        groups[ranks] = dist.new_group(list(ranks))
    return groups[ranks]


def _flat_all_reduce(grads: list[torch.Tensor], group, op) -> None:
    """One collective per dtype for a list of gradients (a bucket), written back in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=op, group=group)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def reduce_gradients(ownership: Ownership, groups: PipelineGroups) -> None:
    """After the step's last backward: sum shared parameters' gradients over their owners, then average
    every gradient over the data-parallel units."""
    with torch.no_grad():
        for group, indices in ownership.shared:
            grads = [g for g in (ownership.gradient(i, zeros=True) for i in indices) if g is not None]
            if not ownership.ties_checked:
                _check_same_pieces(group, grads)
            if grads:
                _flat_all_reduce(grads, group, dist.ReduceOp.SUM)
        ownership.ties_checked = True
        if ownership.zero:
            job_accumulation().flush()    # ZeRO tensors: their replicas' gradients reduce-scattered into the rows
        if groups.dp_group is not None:
            grads = [t.grad for i, t in ownership.held.items() if t.grad is not None and i not in ownership.zero]
            for grad in grads:
                grad.div_(groups.dp_size)
            _flat_all_reduce(grads, groups.dp_group, dist.ReduceOp.SUM)


def _check_same_pieces(group, grads: list[torch.Tensor]) -> None:
    """A shared tensor's copies must be split alike on the stages holding it (hybrid: each stage's tp plan
    chose its placement); different shapes would sum unrelated pieces."""
    shapes = torch.tensor([n for g in grads for n in (g.dim(), *g.shape)] or [0], dtype=torch.int64)
    length = torch.tensor([shapes.numel()])
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, length, group=group)
    if len({int(n) for n in lengths}) == 1:
        everyone = [torch.zeros_like(shapes) for _ in lengths]
        dist.all_gather(everyone, shapes, group=group)
        if all(torch.equal(e, shapes) for e in everyone):
            return
    raise RuntimeError("dynshard: a parameter shared by two pipeline stages (a tied embedding and LM head) is "
                       "split differently on them, so its gradients cannot be summed; give both uses the same "
                       "placement (e.g. a declarative plan) or untie them")


class FreshGradients:
    """Gradients of one step's backward, apart from what ``.grad`` held before it (a user accumulating
    over several calls): the reduction must see only the new part, then the old part is added back."""

    def __init__(self, ownership: Ownership):
        self.ownership = ownership
        self.stashed: dict[int, torch.Tensor] = {}

    def __enter__(self):
        for index, tensor in self.ownership.held.items():
            if tensor.grad is not None:
                self.stashed[index] = tensor.grad
                tensor.grad = None
        return self

    def __exit__(self, *exc):
        for index, old in self.stashed.items():
            tensor = self.ownership.held[index]
            if tensor.grad is not None:
                old.add_(tensor.grad)
            tensor.grad = old
        return False
