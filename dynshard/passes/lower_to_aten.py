"""Lower Dynamo's torch-level graph to ATen ops on FakeTensors of the global shapes."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .. import compat
from .context import PassContext
from .op_sets import RESHAPES
from .sharding_decompositions import sharding_decompositions
from .tag_recompute import is_rng


def lower_to_aten(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Units of one rank (data parallelism, ZeRO) have nothing to place: their Dynamo graph only gains
    the data-parallel wrappers, and aot_autograd lowers it once, in the compile. Recompute tags need
    ATen ops, so ``recompute_modules`` lowers here too."""
    if not lowers(ctx.layout, ctx.outline):
        return gm
    return lower(gm, ctx)


def lowers(layout, outline) -> bool:
    """Whether the passes lower the graph to ATen (at static sizes: a symbolic graph's program is then
    compiled once per size, see ``backend.shapes``): a unit of several ranks places its ops, and recompute
    tags ATen ops."""
    return layout.tp_mesh is not None or bool(outline.recompute)


def splits_sequence(config) -> bool:
    """Whether the config's plan splits the sequence (the tp policy's ``context_parallel``): attention is then
    kept whole even with a mask, for :mod:`.context_parallel_attention` to run."""
    return config.policy == "tp" and int(config.pas_config.get("context_parallel", 1)) > 1


def lower(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The ATen graph of ``gm`` on FakeTensors of its inputs' global shapes."""
    decompositions = sharding_decompositions(splits_sequence(ctx.config))
    aten_gm = compat.trace_to_aten(gm, ctx.fake_inputs(), ctx.fake_mode, decompositions)
    ctx.draws_random = any(is_rng(node) for node in aten_gm.graph.nodes)
    return _drop_legacy_empty_cat_inputs(_split_addmm(_views_to_reshapes(aten_gm)))


# what a torch function, method or module that may draw random numbers is called
_MAY_DRAW = re.compile(r"dropout|rand|bernoulli|normal|uniform|multinomial|exponential|cauchy|geometric|poisson|"
                       r"scaled_dot_product_attention", re.IGNORECASE)


def draws_random(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether Dynamo's graph ``gm`` draws random numbers, as its ATen graph says (``ctx.draws_random``), for a
    caller that needs to know before the graph is lowered for its program (a pipeline's stages are lowered at
    their first call). Lowered only where some call's name could draw."""
    def name(node: fx.Node) -> str:
        if node.op == "call_module":
            return type(gm.get_submodule(node.target)).__name__
        return getattr(node.target, "__name__", str(node.target))

    if any(node.op in ("call_function", "call_method", "call_module") and _MAY_DRAW.search(name(node))
           for node in gm.graph.nodes):
        lower(gm, ctx)
    return ctx.draws_random


def _drop_legacy_empty_cat_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``torch.cat`` skips 1-D empty tensors whatever the dimension (transformers' KV cache starts as
    ``torch.tensor([])``); DTensor's strategy for cat does not, so they are removed from its inputs."""
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.target is not aten.cat.default:
            continue
        tensors = list(node.args[0])
        kept = [t for t in tensors if not _legacy_empty(t)]
        if kept and len(kept) < len(tensors):
            node.args = (kept, *node.args[1:])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _legacy_empty(node) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


def _split_addmm(gm: fx.GraphModule) -> fx.GraphModule:
    """``addmm(bias, a, b)`` -> ``mm(a, b) + bias``. When the matmul leaves a partial sum, DTensor would
    otherwise fold the bias into the partial (dividing it among ranks), and the backward would carry
    partial gradients into the next matmul; split, the partial is reduced first and the bias added once.
    Inductor fuses the add back."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.target is not aten.addmm.default or node.kwargs or len(node.args) != 3:
            continue
        bias, a, b = node.args[:3]
        reshape = _only_reshape_keeping_last_dim(node)
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.mm.default, (a, b))
            product.meta.update(node.meta)
            if reshape is not None:     # reshape the product, then add: the partial is reduced on the
                with gm.graph.inserting_before(reshape):   # model's shape (e.g. along the sequence)
                    shaped = gm.graph.call_function(reshape.target, (product, *reshape.args[1:]))
                    summed = gm.graph.call_function(aten.add.Tensor, (shaped, bias))
                shaped.meta.update(reshape.meta)
                summed.meta.update(reshape.meta)
                reshape.replace_all_uses_with(summed)
                gm.graph.erase_node(reshape)
            else:
                summed = gm.graph.call_function(aten.add.Tensor, (product, bias))
                summed.meta.update(node.meta)
                node.replace_all_uses_with(summed)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _only_reshape_keeping_last_dim(node: fx.Node) -> fx.Node | None:
    """The reshape that is ``node``'s only reader, if it keeps the last dimension (a bias added after
    it broadcasts the same way)."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    out, shaped = node.meta.get("val"), user.meta.get("val")
    if user.target not in RESHAPES or out is None or shaped is None or user.args[0] is not node:
        return None
    return user if shaped.dim() >= 1 and shaped.shape[-1] == out.shape[-1] else None


def _views_to_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """A ``view`` was legal for the strides seen while tracing one process; a shard can be laid out
    differently (DTensor picks its own local strides), so views become reshapes, which copy only where
    they must. Views of ``expand`` stay: they only fold broadcast dimensions (the batched matmuls of
    attention), and DTensor shards those views where it would gather the reshape."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default and getattr(node.args[0], "target", None) \
                is not torch.ops.aten.expand.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm
