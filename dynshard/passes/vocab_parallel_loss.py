"""Cross-entropy over logits split along the vocabulary, without gathering them (Megatron's
VocabParallelCrossEntropy, DTensor's ``loss_parallel``).

``F.cross_entropy`` reaches the ATen graph as ``_log_softmax(logits, 1)`` read only by
``nll_loss_forward``. When the logits arrive split along the class dimension (the LM head split along
the vocabulary), the pair runs as one op: each rank takes the max and the sum of exponentials over its
columns, and the logit of each row's target from the rank that holds it, three all-reduces of one value
per row where gathering the logits would move all of them. Its backward, ``softmax - onehot`` on the
local columns, needs no communication.

The pair is fused (rather than enabling DTensor's ``loss_parallel`` handlers op by op) because the
handlers' log_softmax backward only passes its gradient through, which is right only when nothing but
the nll_loss reads the log-probabilities; here that is checked on the graph. Other log_softmax or
nll_loss ops keep DTensor's own strategies.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import compat
from .op_sets import aten


def loss_pairs(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """{nll_loss_forward node: the _log_softmax node it reads}, for log_softmax over the class
    dimension whose only reader is that nll_loss."""
    pairs = {}
    for node in graph.nodes:
        if node.target is not aten._log_softmax.default or len(node.users) != 1:
            continue
        (user,) = node.users
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if user.target is not aten.nll_loss_forward.default or user.args[0] is not node or value is None:
            continue
        if node.args[1] % value.dim() == (1 if value.dim() >= 2 else 0):
            pairs[user] = node
    return pairs


def split_on_classes(value) -> bool:
    """Whether a value is a DTensor split along its class dimension (and nothing else)."""
    if not isinstance(value, DTensor) or len(value.placements) != 1:
        return False
    class_dim = 1 if value.dim() >= 2 else 0
    placement = value.placements[0]
    return type(placement) is Shard and placement.dim % value.dim() == class_dim


def abstract_log_softmax(logits: DTensor, half_to_float: bool) -> DTensor:
    """The (fake) result of the pair's log_softmax: the logits' placement and shape."""
    local = logits.to_local()
    dtype = torch.float32 if half_to_float else local.dtype
    return DTensor.from_local(torch.empty_like(local, dtype=dtype), logits.device_mesh, logits.placements,
                              run_check=False, shape=logits.shape, stride=logits.stride())


def abstract_nll_loss(log_probs: DTensor, target, weight, reduction: int, ignore_index: int):
    """The (fake) outputs of the pair's nll_loss: replicated, shaped as on the whole tensor."""
    whole = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.to_local().device)
    out = aten.nll_loss_forward.default(whole, _whole(target), _whole(weight), reduction, ignore_index)
    mesh = log_probs.device_mesh
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in out)


def rows(log_probs) -> int:
    """Values each all-reduce of the pair carries: one per row."""
    return log_probs.shape[0] if log_probs.dim() >= 2 else 1


def _whole(value):
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            value = value.redistribute(value.device_mesh, [Replicate()] * len(value.placements))
        return value.full_tensor()
    return value


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, reduction, ignore_index, half_to_float):
        mesh = logits.device_mesh
        target_local, weight_local = _whole(target), _whole(weight)
        out, total_weight, logp = compat.loss_parallel_forward(
            logits.to_local(), target_local, weight_local, reduction, ignore_index, logits.shape, mesh,
            half_to_float)
        ctx.save_for_backward(logp, target_local, total_weight, *(() if weight_local is None else (weight_local,)))
        ctx.args = (reduction, ignore_index, logits.shape, logits.stride(), logits.placements, mesh)
        outputs = tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (out, total_weight))
        ctx.mark_non_differentiable(outputs[1])
        return outputs

    @staticmethod
    def backward(ctx, grad_out, _grad_total_weight):
        logp, target, total_weight, *weight = ctx.saved_tensors
        reduction, ignore_index, shape, stride, placements, mesh = ctx.args
        if isinstance(grad_out, DTensor):
            grad_out = grad_out.redistribute(mesh, [Replicate()]).to_local()
        grad = compat.loss_parallel_backward(grad_out, logp, target, weight[0] if weight else None, reduction,
                                             ignore_index, total_weight, shape, mesh)
        return (DTensor.from_local(grad.to(logp.dtype), mesh, placements, run_check=False, shape=shape,
                                   stride=stride), None, None, None, None, None)


def vocab_parallel_cross_entropy(logits, target, weight, reduction, ignore_index, half_to_float=False):
    """``nll_loss_forward(_log_softmax(logits, 1), target, weight, reduction, ignore_index)`` over logits
    split along the class dimension: (loss, total_weight)."""
    return VocabParallelCrossEntropy.apply(logits, target, weight, reduction, ignore_index, half_to_float)


def fuse_vocab_parallel_losses(graph: fx.Graph, fused: set[str]) -> None:
    """Rewrite the pairs whose nll_loss node is named in ``fused`` (propagation found its logits split
    along the vocabulary) into one :func:`vocab_parallel_cross_entropy`."""
    for nll, log_softmax in loss_pairs(graph).items():
        if nll.name not in fused:
            continue
        logits, _, half_to_float = log_softmax.args
        _, target, weight, reduction, ignore_index = nll.args
        with graph.inserting_before(nll):
            new = graph.call_function(vocab_parallel_cross_entropy,
                                      (logits, target, weight, reduction, ignore_index, half_to_float))
        nll.replace_all_uses_with(new)
        graph.erase_node(nll)
        graph.erase_node(log_softmax)
