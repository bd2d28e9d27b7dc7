"""Means over counted targets: how a mean-reduced cross-entropy combines exactly over micro-batches.

``F.cross_entropy(logits, target)`` (and ``F.nll_loss``) with ``reduction="mean"`` divides a sum over
the targets not equal to ``ignore_index`` by their *total weight*: their count, or the sum of their
class weights (``weight=``); label smoothing divides its term by the same total. With padded targets
(transformers' labels, -100) that total differs between micro-batches, so the batch's loss is not the
mean of the micro-batch losses L_i but their mean weighted by the micro-batch totals W_i:

    L = sum_i W_i L_i / sum_i W_i,     dL/dθ = sum_i (W_i / W) dL_i/dθ    (W = sum_i W_i)

(W_i depends on the targets only, never on a parameter, so the gradient is exact too). A micro-batch
whose targets are all ignored has W_i = 0 and L_i = 0/0: it adds nothing (one process ignores its rows
too).

:mod:`.microbatch_outputs` recognises such a call in the Dynamo graph (the node calls ``F.cross_entropy``
or ``F.nll_loss`` with class-index targets and ``reduction="mean"``), runs it with ``reduction="sum"``
on the micro-batch mesh (a partial sum over the micro-batches, label smoothing included), and calls the
result a mean weighted by that call's total weight. The combine kind it returns is
:class:`WeightedMean`: equal to ``"mean"`` (for callers that only ask the kind), and able to compute the
W_i of a call's micro-batches from the graph inputs: the part of the graph that computes the target (a
shift of the labels, ``labels[:, 1:]``, included) and the class weights runs again on the whole batch,
and the target is cut into the micro-batches along the dimension the batch split gives it.

Two more calls run with ``reduction="sum"`` there, for another reason: ``F.cross_entropy`` over class
probabilities (a floating-point target) and ``F.kl_div(..., reduction="batchmean")`` divide by a number of
samples they take from their input's shape. Each stage runs them at the micro-batch's shape, so each
micro-batch divides by its own size and they are plain means; their decompositions run on the whole
batch's shapes would divide by the whole batch's size, which reads as a sum.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

_SIGNATURES = {f: inspect.signature(f) for f in (F.cross_entropy, F.nll_loss, F.kl_div)}


@dataclasses.dataclass(frozen=True)
class MeanLoss:
    """A ``F.cross_entropy`` / ``F.nll_loss`` call of the graph with ``reduction="mean"`` (or a
    ``F.kl_div`` with ``reduction="batchmean"``, ``ignore_index`` None: a mean over the samples)."""

    node: fx.Node
    target: Any                 # the fx node (or value) of its target
    weight: Any                 # the fx node (or value) of its class weights, or None
    ignore_index: int | None
    reduction: str = "mean"

    def counts_targets(self, target) -> bool:
        """Whether the call divides by its total weight of counted targets (class-index targets), rather
        than by a number of elements or samples, which is the same in every micro-batch: class
        probabilities (``cross_entropy`` with a floating-point target) and ``kl_div``'s batchmean.
        Either way the micro-batch program divides by *its own* count: a ``Partial(avg)``, where running
        the call's decomposition on the whole batch's shapes would divide by the whole batch's count and
        call it a sum."""
        return self.ignore_index is not None and not (isinstance(target, torch.Tensor) and
                                                      target.dtype.is_floating_point)

    @property
    def key(self) -> tuple:
        """Calls with the same key divide by the same total weight."""
        return (_identity(self.target), _identity(self.weight), self.ignore_index)

    def summed(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's (evaluated) arguments with ``reduction="sum"``."""
        bound = _SIGNATURES[self.node.target].bind(*args, **kwargs)
        return (), {**bound.arguments, "reduction": "sum"}


def mean_loss(node: fx.Node) -> MeanLoss | None:
    """The call ``node`` makes, if it is a mean-reduced ``F.cross_entropy`` / ``F.nll_loss`` or a batchmean
    ``F.kl_div`` (legacy ``size_average`` / ``reduce`` arguments are not: the ATen op's check sees those)."""
    signature = _SIGNATURES.get(node.target) if node.op == "call_function" else None
    if signature is None:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments["size_average"] is not None or arguments["reduce"] is not None:
        return None
    if node.target is F.kl_div:
        if arguments["reduction"] != "batchmean":
            return None
        return MeanLoss(node, arguments["target"], None, None, "batchmean")
    if arguments["reduction"] != "mean":
        return None
    ignore_index = arguments["ignore_index"]
    if not isinstance(ignore_index, int):
        return None
    return MeanLoss(node, arguments["target"], arguments["weight"], ignore_index)


class WeightedMean(str):
    """Combine kind "mean" (it compares equal to ``"mean"``) whose micro-batches weigh by the total
    weight of their counted targets (:meth:`totals`), not equally."""

    module: fx.GraphModule | None       # the graph's inputs -> (target, class weights or None)
    inputs: tuple[int, ...]             # the graph inputs it reads (placeholder indices, in its order)
    dim: int                            # the target's dimension that the micro-batches split
    ignore_index: int
    source: str                         # the loss call, for messages

    def __new__(cls, module: fx.GraphModule | None = None, inputs: Sequence[int] = (), dim: int = 0,
                ignore_index: int = -100, source: str = ""):
        self = super().__new__(cls, "mean")
        self.module, self.inputs, self.dim = module, tuple(inputs), dim
        self.ignore_index, self.source = ignore_index, source
        return self

    def __reduce__(self):
        return (WeightedMean, (self.module, self.inputs, self.dim, self.ignore_index, self.source))

    def describe(self) -> str:
        return f"mean weighted by the total weight of the counted targets of {self.source}"

    def totals(self, args: Sequence[Any], nmicros: int) -> torch.Tensor:
        """W_i for each of the ``nmicros`` micro-batches of the whole batch whose graph inputs are ``args``
        (float64)."""
        try:
            with torch.no_grad():
                target, weight = self.module(*[args[i] for i in self.inputs])
                counted = target != self.ignore_index
                if weight is None:
                    each = counted.to(torch.float64)
                else:
                    each = weight.detach().to(torch.float64)[target.masked_fill(~counted, 0)] * counted
                return torch.stack([part.sum() for part in each.chunk(nmicros, self.dim)])
        except Exception as error:     # noqa: BLE001 (e.g. class weights this rank does not hold)
            raise RuntimeError(
                f"dynshard: the counted targets of each micro-batch (to weigh the micro-batch losses of "
                f"{self.source}) could not be computed from the batch on this rank: {type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}. Compute the loss with "
                f"reduction='sum' and divide it by a count passed in as an input") from error

    def scales(self, args: Sequence[Any], nmicros: int) -> torch.Tensor:
        """W_i / W: each micro-batch's share of the batch's loss (its gradient seed's factor)."""
        totals = self.totals(args, nmicros)
        return totals / totals.sum()

    def combine(self, pieces: Sequence[torch.Tensor], args: Sequence[Any]) -> torch.Tensor:
        """sum_i W_i L_i / W from the micro-batch losses ``pieces``; a micro-batch with no counted target
        (L_i = 0/0) adds nothing."""
        totals = self.totals(args, len(pieces)).to(pieces[0].device)
        stacked = torch.stack(pieces).to(torch.float64)
        shape = (-1,) + (1,) * (stacked.dim() - 1)
        weighted = torch.where(totals.view(shape) > 0, stacked * totals.view(shape), torch.zeros_like(stacked))
        return (weighted.sum(0) / totals.sum()).to(pieces[0].dtype)


def weighted_mean(gm: fx.GraphModule, loss: MeanLoss, dim: int, source: str) -> WeightedMean:
    """The :class:`WeightedMean` of ``loss``'s calls, whose target the micro-batches split along ``dim``."""
    module, inputs = _subgraph(gm, [loss.target, loss.weight])
    return WeightedMean(module, inputs, dim, loss.ignore_index, source)


def _subgraph(gm: fx.GraphModule, wanted: list) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """A module computing the values ``wanted`` (fx nodes, or values returned as they are) from the graph
    inputs they depend on, and the indices of those inputs."""
    needed: set[fx.Node] = set()
    stack = [n for n in wanted if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, env, inputs = fx.Graph(), {}, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node in needed:
            if node.op == "placeholder":
                inputs.append(placeholders.index(node))
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] if isinstance(n, fx.Node) else n for n in wanted))
    return fx.GraphModule(gm, graph), tuple(inputs)


def _identity(value) -> Any:
    return value if isinstance(value, (fx.Node, int, float, str, type(None))) else id(value)
