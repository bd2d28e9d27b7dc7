"""A mean-reduced ``nll_loss`` becomes its sum divided by its total weight, so that it stays exact when
its rows are split over the ranks of a plan unit.

``aten.nll_loss_forward(log_probs, target, weight, Mean, ignore_index)`` (what ``F.cross_entropy`` and
``F.nll_loss`` reach) is the sum of ``-weight[t] * log_probs[t]`` over the targets not equal to
``ignore_index``, divided by their total weight: their count, or the sum of their class weights (its
second output). DTensor's strategy for it over batch-split targets is ``Partial(avg)``: each rank's mean,
averaged over the ranks. That is the batch's mean only when every rank holds the same total weight, which
padded targets (transformers' labels, -100) break: with one mostly padded row of four the loss was off by
1.7e-3 (the gradient was right: DTensor's backward divides by the all-reduced total weight).

Rewritten as ``nll_loss_forward(..., Sum, ...)`` and a division of its two outputs, the sum and the total
weight are both ``Partial(sum)``; propagation reduces them where they are produced (the same two
all-reduces of one value DTensor's version costs), and their quotient is the one-process mean; the
backward of the division seeds the sum with 1 / total weight. On a unit whose rows are not split nothing
changes but one division (which the kernel did anyway), and the vocabulary-parallel cross-entropy
(``vocab_parallel_loss``) takes the sum as it took the mean.

Label smoothing and class weights need nothing more: ``cross_entropy``'s decomposition already divides the
smoothing term's sum by the sum of the counted targets' weights, two partial sums DTensor reduces before
dividing.

Units of one rank (``layout.tp_mesh`` None) keep their graph: nothing is split there.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .context import PassContext

_aten = torch.ops.aten
_NLL_LOSSES = (_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2          # torch's Reduction::Mean, Reduction::Sum


def exact_mean_losses(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Pass: every mean-reduced ``nll_loss_forward`` / ``nll_loss2d_forward`` becomes the same op with
    ``Sum`` and a division of its output by its total weight."""
    if ctx.layout.tp_mesh is None:
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _NLL_LOSSES and _reduction(node) == _MEAN:
            changed = _as_sum_over_total_weight(gm.graph, node) or changed
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _reduction(node: fx.Node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", _MEAN)


def _as_sum_over_total_weight(graph: fx.Graph, node: fx.Node) -> bool:
    outputs = {0: [], 1: []}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] not in outputs:
            return False        # the tuple itself is read: leave the op as it is
        outputs[user.args[1]].append(user)
    if not outputs[0]:
        return False            # the loss is never read
    if len(node.args) > 3:
        node.args = (*node.args[:3], _SUM, *node.args[4:])
    else:
        node.kwargs = {**node.kwargs, "reduction": _SUM}
    value = node.meta.get("val")
    with graph.inserting_after(node):
        total = outputs[1][0] if outputs[1] else graph.call_function(operator.getitem, (node, 1))
    for loss in outputs[0]:
        last = max((total, loss), key=lambda n: _position(graph, n))
        with graph.inserting_after(last):
            mean = graph.call_function(_aten.div.Tensor, (loss, total))
        loss.replace_all_uses_with(mean, delete_user_cb=lambda user, mean=mean: user is not mean)
        for new in (total, mean):
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in node.meta and key not in new.meta:
                    new.meta[key] = node.meta[key]
        if isinstance(value, tuple) and len(value) == 2:
            total.meta.setdefault("val", value[1])
            mean.meta["val"] = value[0]      # the mean's metadata: the op's mean output's
            loss.meta["val"] = value[0]      # (the sum has the same shape and dtype)
    return True


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(f"{node} is not in the graph")
