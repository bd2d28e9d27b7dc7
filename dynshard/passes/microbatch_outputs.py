"""How the outputs of m micro-batches combine into the outputs of the whole batch (pipeline parallelism).

A pipeline runs the captured graph once per micro-batch: every batch input split along dim 0 into
``nmicros`` equal parts. Each graph output must then be rebuilt exactly as the whole batch gives it:

==========  ==========================================================  =====================
kind        the whole-batch output is                                    gradient seed (each)
==========  ==========================================================  =====================
``"cat"``   the micro-batch outputs concatenated along dim 0 (logits)    its slice of the grad
``"mean"``  their mean (a mean-reduced loss: ``F.mse_loss``, ``.mean()``)   grad / m
            or, for a loss normalised by its count of counted targets        grad W_i / W
            (mean-reduced ``F.cross_entropy`` / ``F.nll_loss``: padded
            targets, class weights), their mean weighted by those counts
            W_i (:class:`~.microbatch_weights.WeightedMean`)
``"sum"``   their sum (``reduction="sum"``, ``.sum()``)                  grad
``"same"``  any one of them: the output does not depend on the batch     grad / m
==========  ==========================================================  =====================

(:func:`seed_scale` gives the scale.) Anything else is refused with :class:`MicrobatchError`, which
names the op, its source line and what to do: an op that needs the whole batch at once (BatchNorm's
batch statistics, a max over the batch, indexing one row of the batch), a sum or mean over the batch
used non-linearly (normalised by a count computed from the batch, squared, ...), an output split along
another dimension, or a graph input updated in place (it would be updated once per micro-batch).

How: DTensor's own sharding propagation. The split is Shard(0) of each batch input over a 1-D mesh of
``nmicros`` "ranks" (the micro-batches), everything else Replicate; the Dynamo graph runs on DTensors
whose local tensors are meta tensors, under a dispatch mode that asks DTensor, before every ATen op,
which redistribution its strategy needs. A micro-batch program is the same program on every
micro-batch, with no communication, so only redistributions that are local and change no value are
allowed (Replicate -> Shard: the micro-batch's slice of a batch-independent value; Replicate ->
Partial(avg): a constant added to a mean); any other (an all-gather of the batch, an all-reduce of a
partial sum or mean) is where the micro-batches stop combining, and is refused there, naming the op.
The outputs' placements then give the answer: Shard(0) -> cat, Partial(avg) -> mean, Partial(sum) ->
sum, Replicate -> same. Mean-of-means is exact because the micro-batches have equal size (checked).
A mean-reduced ``F.cross_entropy`` / ``F.nll_loss`` call over class-index targets is the one exception:
it is normalised by the total weight of its counted targets (not equal to ``ignore_index``; the sum of
their class weights with ``weight=``), which differs per micro-batch. It runs here with
``reduction="sum"`` (a partial sum, label smoothing included) and its result is a mean weighted by that
total (:mod:`.microbatch_weights`); what is computed from it linearly (scaled, shifted by a constant)
stays one. Combined with a plain mean, or with another loss's weighted mean (another target), it is
refused: no weighting of the micro-batch outputs gives the batch's.
Ops DTensor has no strategy for run through their decomposition (:mod:`.sharding_decompositions`),
BatchNorm always (so that eval mode is elementwise and training mode shows its batch statistics);
random ops and convolutions are placed here (DTensor's versions touch global RNG state / ask the
default process group for its rank).

The mesh has no process group behind it (:func:`dynshard.compat.abstract_device_mesh`) and nothing is
ever communicated, so this runs the same with no process group, a fake one, or a real one of any size.
A 4-layer GPT takes about 0.1 s (0.3 s the first time in a process: DTensor fills its sharding cache).

Exactness notes:

* DTensor treats a mean-reduced ``nll_loss`` as Partial(avg), which is exact only when every micro-batch
  has the same total weight of counted targets. Reached through ``F.cross_entropy`` / ``F.nll_loss`` it is
  weighted (above); a mean-reduced ``aten.nll_loss_forward`` reached any other way over split inputs is
  refused, whatever its ``ignore_index`` and class weights (padding cannot be ruled out from the graph).
* The micro-batch program meant here is the whole-batch graph run on a slice, as DTensor runs it
  locally: Python numbers Dynamo specialised in the graph keep their whole-batch values. A loss written
  ``loss.sum() / x.shape[0]`` divides by the whole batch size in the graph, so it is a "sum" here; a
  runtime that re-captures the model at the micro-batch shape divides by the micro-batch size instead
  and would have to treat it as a "mean". A torch function that divides by a size of its own input
  inside (``F.cross_entropy`` over class probabilities, ``F.kl_div(..., reduction="batchmean")``) runs
  at the micro-batch's shape in each stage, so it divides by the micro-batch's size: it runs here with
  ``reduction="sum"`` and is a "mean" (run on the whole batch's shapes, its decomposition divided by the
  whole batch's size and called it a "sum": a plain call under ``pp`` returned m times the loss).
* Conservative: a value of the batch normalised by a count computed from the batch outside the losses
  above is refused even when the count is the same in every micro-batch (``x.sum() / (y > 0).sum()``),
  and so is indexing the batch with ``torch.arange(B)`` where B is a number (a static graph); a symbolic
  graph's ``torch.arange`` over its batch's size input indexes each micro-batch's rows
  (:mod:`.microbatch_positions`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.multiprocessing.reductions import StorageWeakRef

from .. import compat
from ..compat import TorchDispatchMode, pytree
from .microbatch_positions import NOT_HERE, BatchPositions
from .microbatch_weights import WeightedMean, mean_loss, weighted_mean
from .propagate_sharding import source_line
from .sharding_decompositions import sharding_decompositions

KINDS = ("cat", "mean", "sum", "same")

_aten = torch.ops.aten
_NLL_LOSSES = (_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default)
# decomposed even though DTensor has a strategy: DTensor's batch norm needs the batch whole even in eval
# mode; decomposed, eval mode is elementwise and training mode shows its statistics over the batch
_DECOMPOSED = (_aten.native_batch_norm.default,)
_MEAN = 1                      # torch's Reduction::Mean


class MicrobatchError(ValueError):
    """An output of the graph cannot be rebuilt exactly from its micro-batch outputs."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message   # fx.Interpreter appends the node to args[0]; this stays as written


def seed_scale(kind: str, nmicros: int) -> float:
    """The factor on an output's gradient for each micro-batch's backward: 1/m for "mean" (and "same",
    whose gradient would otherwise count m times), 1 for "sum"; for "cat" each micro-batch takes its
    own slice of the gradient (factor 1). A :class:`WeightedMean` has one factor per micro-batch, which
    depends on the batch: ``kind.scales(graph_inputs, nmicros)``."""
    if kind not in KINDS:
        raise ValueError(f"unknown combine kind {kind!r}; expected one of {KINDS}")
    if isinstance(kind, WeightedMean):
        raise ValueError(f"dynshard: the micro-batches of a {kind.describe()} do not weigh the same; their "
                         f"factors depend on the batch: kind.scales(graph_inputs, nmicros)")
    return 1.0 / nmicros if kind in ("mean", "same") else 1.0


def microbatch_combine(gm: fx.GraphModule, example_inputs: Sequence[Any], batch_inputs: Sequence[int],
                       nmicros: int, batch_sizes: Sequence[int] = ()) -> list[str]:
    """How each output of ``gm`` combines over ``nmicros`` micro-batches: "cat", "mean", "sum" or "same";
    a mean weighted by each micro-batch's count of counted targets is a :class:`WeightedMean` (equal to
    "mean"; its ``combine(pieces, graph_inputs)`` and ``scales(graph_inputs, nmicros)`` weigh them).

    ``gm`` is a Dynamo-captured graph (parameters are placeholders too), ``example_inputs`` its example
    inputs (real or fake tensors; only their metadata is read), ``batch_inputs`` the indices of the
    placeholders split along dim 0, ``batch_sizes`` those of a symbolic graph's size inputs that are the
    batch's size (divided with the batch: :mod:`.microbatch_positions`). Raises :class:`MicrobatchError`
    for an output that no combination of the micro-batch outputs gives exactly, or when a batch input does
    not split into ``nmicros`` equal parts.
    With one micro-batch every output is "same" (the micro-batch is the batch).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(f"the graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs "
                         f"were given")
    if not isinstance(nmicros, int) or nmicros < 1:
        raise ValueError(f"nmicros must be a positive int, got {nmicros!r}")
    batch = sorted(set(batch_inputs))
    for index in batch:
        if not 0 <= index < len(example_inputs):
            raise ValueError(f"batch input index {index} is out of range: the graph has {len(example_inputs)} inputs")
        value = example_inputs[index]
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"batch input {index} ({_input_name(placeholders[index])}) is not a tensor with a "
                             f"batch dimension: {type(value).__name__}{list(getattr(value, 'shape', []))}")
        if value.shape[0] % nmicros:
            raise MicrobatchError(
                f"dynshard: batch input {_input_name(placeholders[index])} has batch size {value.shape[0]}, which "
                f"does not split into {nmicros} equal micro-batches (a mean over unequal micro-batches is not the "
                f"mean over the batch); use a batch size divisible by the number of micro-batches")
    outputs = _output_values(gm)
    if nmicros == 1:
        return ["same"] * len(outputs)
    if not batch:
        return ["same"] * len(outputs)

    # Local tensors on the meta device, whatever device the model runs on: only shapes matter, and meta
    # kernels are the cheapest way to them (FakeTensors cost twice as much here). The mesh is a CPU one for
    # the same reason: no device-specific path in DTensor (RNG trackers, device handles) is ever taken.
    # Replicated inputs keep their strides; a micro-batch is a dim-0 slice, so it keeps them too.
    mesh = compat.abstract_device_mesh("cpu", nmicros, "dynshard_microbatches")
    args, unsplit, inputs = [], {}, {}
    for index, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            args.append(value)
            continue
        split = index in batch
        shape = (value.shape[0] // nmicros, *value.shape[1:]) if split else tuple(value.shape)
        local = torch.empty_strided(shape, tuple(value.stride()), dtype=value.dtype, device="meta")
        storage = StorageWeakRef(local.untyped_storage())
        inputs[storage] = placeholders[index]
        if not split:
            unsplit[storage] = placeholders[index]
        args.append(DTensor.from_local(local, mesh, [Shard(0) if split else Replicate()], run_check=False,
                                       shape=value.shape, stride=tuple(value.stride())))
    mode = _MicrobatchMode(mesh, unsplit, inputs)
    positions = BatchPositions({placeholders[i] for i in batch_sizes}, mesh, mode.refuse_node)
    interpreter = _Interpreter(gm, mode, positions)
    try:
        with torch.no_grad(), mode:
            result = interpreter.run(*args)
    except MicrobatchError as error:      # without the node fx.Interpreter appended: the message names it
        raise MicrobatchError(error.message) from None
    values = result if isinstance(result, (tuple, list)) else (result,)
    kinds = [_kind(i, node, value, nmicros) for i, (node, value) in enumerate(zip(outputs, values))]
    return [interpreter.weighted.get(node, kind) if kind == "mean" and isinstance(node, fx.Node) else kind
            for node, kind in zip(outputs, kinds)]


# -- the outputs ------------------------------------------------------------------------------------------
def _output_values(gm: fx.GraphModule) -> list:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = output.args[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _kind(index: int, node, value, nmicros: int) -> str:
    if not isinstance(value, DTensor):
        return "same"
    (placement,) = value.placements
    if isinstance(placement, Replicate):
        return "same"
    if type(placement) is Shard and placement.dim == 0:
        return "cat"
    what = f"output {index} ({node.name if isinstance(node, fx.Node) else node}, shape {list(value.shape)})"
    where = f" at {source_line(node)}" if isinstance(node, fx.Node) else ""
    if isinstance(placement, Shard):
        raise MicrobatchError(
            f"dynshard: {what}{where} cannot be combined from micro-batches: it holds the batch along "
            f"{'an interleaved layout of ' if type(placement) is not Shard else ''}dimension {placement.dim}, "
            f"not dimension 0, so concatenating the micro-batch outputs along dim 0 does not give it. Return it "
            f"with the batch first (e.g. transpose it back) and rearrange it outside the compiled model")
    if isinstance(placement, Partial) and placement.reduce_op in ("avg", "sum"):
        return "mean" if placement.reduce_op == "avg" else "sum"
    if isinstance(placement, Partial):
        op = placement.reduce_op
        raise MicrobatchError(
            f"dynshard: {what}{where} is a {op} over the batch: the micro-batch outputs would have to be combined "
            f"by {op!r}, and only concatenation, mean and sum are exact (a mean or sum also gives exact "
            f"gradients). Return the per-sample values and reduce them outside the compiled model")
    raise MicrobatchError(f"dynshard: {what}{where} has placement {placement}, which no micro-batch combination gives")


# -- propagation ------------------------------------------------------------------------------------------
class _Interpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mode: "_MicrobatchMode", positions: BatchPositions):
        super().__init__(gm)
        self.mode = mode
        self.positions = positions
        self.weighted: dict[fx.Node, WeightedMean] = {}   # nodes whose value is a weighted mean
        self._by_key: dict[tuple, WeightedMean] = {}      # one per total weight (target, weights, ignore_index)

    def run_node(self, n: fx.Node):
        self.mode.node = n
        if n.op == "output":
            return super().run_node(n)
        # (by identity: every WeightedMean compares equal to "mean")
        sources = {id(self.weighted[a]): self.weighted[a] for a in n.all_input_nodes if a in self.weighted}
        if sources:
            self._check_weighted_inputs(n, list(sources.values()))
        out = self.positions.run(n, self.fetch_args_kwargs_from_env)
        if out is NOT_HERE:
            out = self._weighted_loss(n)
        if out is None or out is NOT_HERE:
            out = super().run_node(n)
        if sources and n not in self.weighted and _has_avg(out):
            (self.weighted[n],) = sources.values()     # a weighted mean scaled, shifted or added to: still one
        return out

    def _weighted_loss(self, n: fx.Node) -> DTensor | None:
        """A mean-reduced cross-entropy / nll_loss of class-index targets split into micro-batches: run with
        reduction="sum", returned as a mean weighted by its total weight (:mod:`.microbatch_weights`). Over
        class probabilities, or a batchmean kl_div: run with reduction="sum", returned as a plain mean (the
        micro-batch divides by its own number of samples). None for any other node (it runs as it is)."""
        loss = mean_loss(n)
        if loss is None:
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = loss.summed(args, kwargs)
        target = kwargs.get("target")
        if not isinstance(target, DTensor):
            return None
        summed = n.target(*args, **kwargs)
        if not isinstance(summed, DTensor) or summed.placements != (Partial("sum"),):
            return None       # it does not depend on the batch (or is refused as it is)
        if not loss.counts_targets(target):
            return DTensor.from_local(summed.to_local(), self.mode.mesh, [Partial("avg")], run_check=False)
        (placement,) = target.placements
        if type(placement) is not Shard:
            raise self.mode.refuse_node(
                f"it is a mean over the targets not equal to ignore_index={loss.ignore_index}, normalised by their "
                f"count, but its targets are not split with the batch ({placement}), so that count cannot be "
                f"found per micro-batch. Compute the targets from the batch inputs, batch first")
        weighted = self._by_key.get(loss.key)
        if weighted is None:
            weighted = weighted_mean(self.module, loss, placement.dim, f"{n.name} at {source_line(n)}")
            self._by_key[loss.key] = weighted
        self.weighted[n] = weighted
        return DTensor.from_local(summed.to_local(), self.mode.mesh, [Partial("avg")], run_check=False)

    def _check_weighted_inputs(self, n: fx.Node, sources: list) -> None:
        if len(sources) > 1:
            raise self.mode.refuse_node(
                "it combines losses normalised by different counts of targets (" +
                "; ".join(sorted(w.source for w in sources)) + "): each micro-batch weighs differently in "
                "each, so no weighting of the micro-batch outputs gives the batch's. Return the losses as "
                "separate outputs")
        for a in n.all_input_nodes:
            if a not in self.weighted and _has_avg(self.env.get(a)):
                (weighted,) = sources
                raise self.mode.refuse_node(
                    f"it combines a mean over the batch's samples ({a.name}) with a mean over counted targets "
                    f"({weighted.source}), whose micro-batches weigh by their counts of targets: no weighting "
                    f"of the micro-batch outputs gives the batch's. Return them as separate outputs")

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return self.mode.replicate(value)
        return value


class _MicrobatchMode(TorchDispatchMode):
    """Checks each ATen op's redistributions on the micro-batch mesh before DTensor runs it."""

    def __init__(self, mesh, unsplit: dict, inputs: dict):
        super().__init__()
        self.mesh = mesh
        self.nmicros = mesh.size()
        self.unsplit = unsplit          # storage -> placeholder of each input that is not split
        self.inputs = inputs            # storage -> placeholder of every tensor input
        self.decomposing: list = []     # ops whose decomposition is running (outermost first)
        self.node: fx.Node | None = None

    def replicate(self, tensor: torch.Tensor) -> DTensor:
        tensor = tensor.to("meta")
        return DTensor.from_local(tensor, self.mesh, [Replicate()], run_check=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        if not any(isinstance(a, DTensor) for a in leaves):
            # factories and ops on constants: the same value in every micro-batch
            if "device" in kwargs:
                kwargs = {**kwargs, "device": torch.device("meta")}
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            try:
                out = func(*args, **kwargs)
            except Exception as error:    # e.g. a data-dependent op, which has no meta kernel
                raise self._refuse(func, _not_abstract(error)) from error
            return pytree.tree_map_only(torch.Tensor, self.replicate, out)
        if "device" in kwargs:      # (x.to(x.device), as transformers' masks do: the local tensors stay on meta)
            kwargs = {**kwargs, "device": torch.device("meta")}
        if any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in leaves):
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t if isinstance(t, DTensor) else self.replicate(t), (args, kwargs))
        self._check_mutation(func, args)
        if func in _NLL_LOSSES:
            self._check_nll_loss(func, args, kwargs)
        if func in _DECOMPOSED:
            return self._decompose(func, args, kwargs)
        try:
            redistributions = compat.dtensor_redistributions(func, args, kwargs)
        except NotImplementedError:     # no strategy: run its decomposition, if it has one, op by op
            if func in sharding_decompositions():
                return self._decompose(func, args, kwargs)
            return self._without_strategy(func, args, kwargs)
        except Exception as error:   # e.g. an uneven split DTensor refuses to average
            raise self._refuse(func, f"DTensor cannot place it on the micro-batches: {str(error).splitlines()[0]}") \
                from error
        sources = [a for a in pytree.arg_tree_leaves(*args) if isinstance(a, DTensor)]
        for source, (current, needed) in zip(sources, redistributions):
            self._check_transition(func, source, current.placements[0], needed.placements[0])
        if torch.Tag.nondeterministic_seeded in func.tags:
            return self._random(func, args, kwargs, redistributions)
        if func is _aten.convolution.default:
            return self._convolution(func, args, kwargs, redistributions)
        try:
            return func(*args, **kwargs)
        except MicrobatchError:
            raise
        except Exception as error:     # e.g. a data-dependent op, which has no meta kernel
            raise self._refuse(func, _not_abstract(error)) from error

    def _decompose(self, func, args, kwargs):
        self.decomposing.append(func)
        try:
            with self:
                return sharding_decompositions()[func](*args, **kwargs)
        finally:
            self.decomposing.pop()

    # -- checks -------------------------------------------------------------------------------------
    def _check_transition(self, func, source: DTensor, src, dst) -> None:
        if src == dst:
            return
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            placeholder = self.unsplit.get(StorageWeakRef(source.to_local().untyped_storage()))
            if placeholder is not None:
                raise self._refuse(
                    func, f"it slices graph input {_input_name(placeholder)} (shape {list(source.shape)}) along "
                          f"dimension {dst.dim} as if it were batch-split, but that input is not split into "
                          f"micro-batches; list it among the batch inputs if it holds one row per sample")
            return      # the micro-batch's slice of a value that does not depend on the batch: local
        if isinstance(src, Replicate) and isinstance(dst, Partial) and dst.reduce_op == "avg":
            return      # c + mean: the mean over micro-batches of (c + their mean) is c + the mean
        if isinstance(src, Shard):
            reason = (f"it needs the whole batch at once (DTensor would gather the micro-batches: {src} -> {dst}); "
                      f"on one micro-batch it computes something else")
        elif isinstance(src, Partial):
            total = "mean" if src.reduce_op == "avg" else src.reduce_op
            reason = (f"it uses the {total} over the whole batch as one value (DTensor would all-reduce it: "
                      f"{src} -> {dst}), e.g. normalises by it or applies a non-linear function to it; each "
                      f"micro-batch only has its own part of that {total}")
        else:
            reason = (f"it adds a value that does not depend on the batch to a sum over the batch ({src} -> {dst}): "
                      f"summed over the micro-batches it would count {self.nmicros} times")
        raise self._refuse(func, reason)

    def _check_nll_loss(self, func, args, kwargs) -> None:
        logits, target, weight, reduction, ignore_index = args[:5]
        if reduction != _MEAN or all(isinstance(t, DTensor) and t.placements == (Replicate(),)
                                     for t in (logits, target)):
            return
        what = "class-weighted mean" if weight is not None else "mean"
        raise self._refuse(
            func, f"it is a {what} over the targets not equal to ignore_index={ignore_index}: it is normalised by the "
                  f"total weight of the counted targets, which differs per micro-batch (padding), so the mean of the "
                  f"micro-batch means is not the mean over the batch. Call F.cross_entropy / F.nll_loss (whose "
                  f"micro-batches dynshard weighs by their counted targets), or use reduction='sum' and divide by "
                  f"the whole batch's count of counted targets, computed outside the compiled model (passed in "
                  f"as an input)")

    def _check_mutation(self, func, args) -> None:
        schema = func._schema
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for leaf in pytree.tree_leaves(value):
                if not isinstance(leaf, DTensor):
                    continue
                storage = StorageWeakRef(leaf.to_local().untyped_storage())
                placeholder = self.inputs.get(storage)
                if placeholder is None:
                    continue
                effect = (f"once per micro-batch, {self.nmicros} times in all, each time from one micro-batch"
                          if storage in self.unsplit else "on each micro-batch's slice of it, not on the batch")
                raise self._refuse(
                    func, f"it updates graph input {_input_name(placeholder)} in place: run per micro-batch, the "
                          f"update happens {effect}. Keep state updates out of the compiled model (modules that "
                          f"track statistics: eval mode)")

    def _without_strategy(self, func, args, kwargs):
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        if all(a.placements == (Replicate(),) for a in leaves if isinstance(a, DTensor)):
            local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda t: t.to_local(), (args, kwargs))
            out = func(*local_args, **local_kwargs)
            return pytree.tree_map_only(torch.Tensor, self.replicate, out)
        raise self._refuse(func, "DTensor has no sharding rule for it, so how its result combines over micro-batches "
                                 "is unknown")

    def _random(self, func, args, kwargs, redistributions):
        """Random ops run here, not in DTensor (whose RNG tracker is global state): the output takes the
        placement of the inputs, as DTensor's strategies for dropout and ``*_like`` give it."""
        placements = {a.placements for a in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(a, DTensor)}
        if len(placements) != 1 or any(c.placements != n.placements for c, n in redistributions):
            raise self._refuse(func, "it is a random op on inputs placed differently")
        return self._locally(func, args, kwargs, placements.pop())

    def _convolution(self, func, args, kwargs, redistributions):
        """DTensor's convolution handler asks the default process group for its rank, even for a batch
        split, where the convolution is local: the output is split as the input is."""
        data, *others = [a for a in pytree.arg_tree_leaves(*args) if isinstance(a, DTensor)]
        if any(c.placements != n.placements for c, n in redistributions) or \
                any(o.placements != (Replicate(),) for o in others):
            raise self._refuse(func, "it is a convolution whose weight or bias depends on the batch")
        return self._locally(func, args, kwargs, data.placements)

    def _locally(self, func, args, kwargs, placements):
        local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda t: t.to_local(), (args, kwargs))
        out = func(*local_args, **local_kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: DTensor.from_local(t, self.mesh, placements,
                                                                                run_check=False), out)

    # -- errors -------------------------------------------------------------------------------------
    def refuse_node(self, reason: str) -> MicrobatchError:
        """The error for the graph node running now (not one of its ATen ops)."""
        node = self.node
        where = f"{node.name} at {source_line(node)}" if node is not None else "?"
        module = _module_path(node)
        return MicrobatchError(f"dynshard: the batch cannot be split into {self.nmicros} micro-batches: graph node "
                               f"{where}{', in ' + module if module else ''}: {reason}.")

    def _refuse(self, func, reason: str) -> MicrobatchError:
        op = self.decomposing[0] if self.decomposing else func
        inner = f" (in its decomposition: {func})" if self.decomposing else ""
        node = self.node
        where = f"{node.name} at {source_line(node)}" if node is not None else "?"
        module = _module_path(node)
        message = (f"dynshard: the batch cannot be split into {self.nmicros} micro-batches: {op}{inner} "
                   f"(graph node {where}{', in ' + module if module else ''}): {reason}.")
        if _is_batch_norm(node, op):
            message = (f"dynshard: BatchNorm in training mode cannot run on {self.nmicros} micro-batches: it "
                       f"normalises by the mean and variance of the batch it sees, and over one micro-batch those "
                       f"statistics differ from the whole batch's, so its outputs (and its running statistics, "
                       f"updated once per micro-batch) would differ from the whole batch's. Put the model in eval "
                       f"mode, use LayerNorm/GroupNorm, or do not split the batch (pipeline_nmicros=1). "
                       f"Details: " + message[len("dynshard: "):])
        return MicrobatchError(message)


def _has_avg(value) -> bool:
    return any(isinstance(leaf, DTensor) and any(isinstance(p, Partial) and p.reduce_op == "avg"
                                                  for p in leaf.placements)
               for leaf in pytree.tree_leaves(value))


def _not_abstract(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"it could not be run on shapes alone ({type(error).__name__}: {lines[0] if lines else ''})"


def _input_name(node: fx.Node) -> str:
    source = compat.grapharg_source_name(node)
    return f"{node.name} ({source})" if source else node.name


def _module_path(node: fx.Node | None) -> str:
    stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return f"{path} ({name})"


def _is_batch_norm(node: fx.Node | None, op) -> bool:
    if "batch_norm" in str(op):
        return True
    if node is None:
        return False
    if "batch_norm" in str(getattr(node.target, "__name__", node.target)):
        return True
    for _, cls in (node.meta.get("nn_module_stack") or {}).values():
        if "BatchNorm" in (getattr(cls, "__name__", None) or str(cls)):
            return True
    return False
