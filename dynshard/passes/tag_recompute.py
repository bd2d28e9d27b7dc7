"""Recompute (activation checkpointing) by module: ``Config(recompute_modules="Block")``.

What it does. Every forward op of the ATen graph that runs inside a module instance named by
``recompute_modules`` gets the partitioner's recompute tags, the ones ``torch.utils.checkpoint`` sets:
``node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE`` and ``node.meta["ac_graph_id"]``, one id per
module *instance* (``blocks.0``, ``blocks.1``, ...), increasing in forward order. aot_autograd copies both
fields from the nodes of this pre-autograd graph to every node of its joint graph (they are in
``torch.fx.proxy._COPY_META_FIELDS``), and its partitioners (``default_partition`` for aot_eager, the
min-cut one for Inductor) then keep only what the tags and region boundaries require: the input of each
instance (``cleanup_recompute_tags`` saves a value read by a later region) and what must be saved, and
re-run the rest of the instance in the backward graph.

Why a pass and not a wrapper around the user's modules: dynshard sees one graph, not the modules; the
modules survive only as ``node.meta["nn_module_stack"]``, which lowering to ATen keeps per op. Tagging
this graph needs no change to the model and composes with tensor parallelism, because the tags are set
after ``insert_collectives`` where dynshard's own communication is visible as separate nodes.

Names (comma-separated, nnScaler's syntax), matched against each entry of a node's module stack:
  - ``ROOT``: the whole compiled program (every forward op, one region).
  - a class name: ``Block`` matches instances of a class whose ``__name__``, ``__qualname__`` or
    ``module.qualname`` is that name (``models.Block``).
  - a module path: the instance's fully qualified name (``blocks.0``) or a dotted suffix of it
    (``attn`` matches ``blocks.0.attn`` and ``blocks.1.attn``; ``0.attn`` matches ``blocks.0.attn``).
  - ``*`` and ``?`` are shell wildcards inside one name or one path component: ``blocks.*`` is every
    child of ``blocks``, ``*Block`` every class whose name ends in ``Block``.
When matched modules nest, the outermost matched instance is the region (it recomputes the inner ones).
A name that matches no module of the graph raises :class:`RecomputeError`, listing the classes and paths
the graph has, at compile time (the first call), before any step runs. The compiled root module itself is
not in the module stack: name it ``ROOT``.

What is never recomputed, so that the backward neither re-communicates nor changes numbers:
  - RNG ops (``torch.Tag.nondeterministic_seeded``: dropout, rand): ``MUST_SAVE``, their outputs kept.
  - SymInt-valued nodes: ``MUST_SAVE``.
  - dynshard's own nodes (Python functions inserted by ``insert_collectives`` and
    ``split_fused_projections``: input wrapping, partial-sum reductions, gathers) are left untagged, so
    the collectives they trace to are saved by the partitioner's ``force_save_collectives``; only those
    that are local in the forward (``LOCAL_IN_FORWARD``) are recomputed with their region.
  - ATen ops for which sharding propagation recorded a redistribution (DTensor communicates inside the
    op) are left untagged for the same reason; a ``PREFER_RECOMPUTE`` that a user's
    ``torch.utils.checkpoint`` put on such an op is removed as well.
A user's ``torch.utils.checkpoint`` keeps working: its tags survive lowering, and nodes it already
tagged keep their tags (and ids) here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
import re
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import compat
from ..config import ConfigError
from .context import PassContext

ROOT = "ROOT"
# ids of dynshard's regions start here, away from torch.utils.checkpoint's own counter (1, 2, ...)
FIRST_REGION_ID = 1_000_000


class RecomputeError(ConfigError):
    """A name in ``recompute_modules`` matches no module of the compiled graph."""


@dataclasses.dataclass(frozen=True)
class Frame:
    """One entry of a node's module stack: the instance's path from the compiled root and its class."""

    path: str
    cls: str          # __name__
    qualnames: tuple[str, ...]   # every spelling of the class a name may use


_ROOT_SOURCE = re.compile(r"^L\['[^']+'\]")
_PATH_PART = re.compile(r"\._modules\['([^']+)'\]|\[\s*'([^']+)'\s*\]|\[\s*(\d+)\s*\]|\.([A-Za-z_0-9]+)")


def module_path(source: str) -> str:
    """``L['self'].blocks.0``, ``L['self']._modules['blocks']._modules['0']`` or ``L['self'].blocks[0]``
    -> ``blocks.0``."""
    root = _ROOT_SOURCE.match(source)
    rest = source[root.end():] if root else source
    parts = [next(g for g in match.groups() if g is not None) for match in _PATH_PART.finditer(rest)]
    return ".".join(parts) if parts else rest.strip(".")


def frames(node: fx.Node) -> list[Frame]:
    """The module instances ``node`` runs in, outermost first."""
    found = []
    for value in (node.meta.get("nn_module_stack") or {}).values():
        source, cls = value if isinstance(value, tuple) else (str(value), "")
        if isinstance(cls, type):
            names = (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
        else:
            text = str(cls).removeprefix("<class '").removesuffix("'>")
            names = (text.rsplit(".", 1)[-1], text)
        found.append(Frame(module_path(str(source)), names[0], tuple(dict.fromkeys(names))))
    return found


def matches(name: str, frame: Frame) -> bool:
    if any(fnmatch.fnmatchcase(q, name) for q in frame.qualnames):
        return True
    pattern, path = name.split("."), frame.path.split(".") if frame.path else []
    return len(pattern) <= len(path) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(path[len(path) - len(pattern):], pattern))


def is_rng(node: fx.Node) -> bool:
    """An op that draws random numbers. Attention kernels carry the RNG tag because they can apply
    dropout; called with ``dropout_p=0`` they draw nothing and may be recomputed."""
    target = node.target
    if getattr(target, "draws_random", False):       # random_draws.draw_whole_fn
        return True
    if not isinstance(target, compat.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    probabilities = [(i, a) for i, a in enumerate(target._schema.arguments) if a.name == "dropout_p"]
    if not probabilities:
        return True
    for index, argument in probabilities:
        value = node.kwargs.get(argument.name, node.args[index] if index < len(node.args) and
                                not argument.kwarg_only else argument.default_value)
        if value != 0:
            return True
    return False


def _communicating_nodes(ctx: PassContext | None) -> set[str]:
    """ATen nodes inside which DTensor redistributes an input (propagation recorded a collective there
    that no inserted reduction node carries)."""
    propagation = getattr(ctx, "propagation", None)
    if propagation is None:
        return set()
    counts: dict[str, int] = {}
    for collective in propagation.collectives:
        counts[collective.node] = counts.get(collective.node, 0) + 1
    # a partial-sum producer records its own reduction, which insert_collectives moved to a separate
    # reduce_partials node; anything beyond that is a redistribution inside the op
    return {name for name, n in counts.items()
            if n > (1 if name in propagation.reduced_partials else 0)} | set(propagation.fallbacks)


# dynshard's inserted functions that never communicate in the forward: Megatron's ``f`` (identity
# forward, all-reduce in the backward, which is not recomputed) and wrapping a constant as a replicated
# DTensor; recomputing them is free and lets the activations they pass on be dropped too. A random op
# drawn whole and sliced is local too; it is tagged as any random op (saved)
LOCAL_IN_FORWARD = ("reduce_grad_partials", "replicate", "draw_whole")


def _is_dynshard_node(node: fx.Node) -> bool:
    """A node that a dynshard pass inserted as a Python function that may communicate (it traces to
    DTensor ops, maybe collectives)."""
    return node.op == "call_function" and not isinstance(node.target, compat.OpOverload) \
        and node.target is not operator.getitem and getattr(node.target, "__name__", "") not in LOCAL_IN_FORWARD


def tag_graph(gm: fx.GraphModule, names: Sequence[str], communicating: set[str] = frozenset()) -> dict[str, int]:
    """Tag ``gm`` in place; returns the region id of every recomputed module instance (path -> id)."""
    graph_frames: dict[fx.Node, list[Frame]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        graph_frames[n] = frames(n)
        if not graph_frames[n] and getattr(n.target, "__name__", "") in LOCAL_IN_FORWARD:
            # inserted by a pass, without a module stack: it belongs where the value it wraps does
            source = next((a for a in n.all_input_nodes if a in graph_frames), None)
            graph_frames[n] = graph_frames.get(source, [])
    _check_names(names, graph_frames)
    whole = ROOT in names
    regions: dict[str, int] = {}
    for node, stack in graph_frames.items():
        if node.name in communicating or _is_dynshard_node(node):
            if node.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE:
                del node.meta["recompute"]          # a user region: do not re-communicate either
                node.meta.pop("ac_graph_id", None)
            continue
        if "recompute" in node.meta:                # torch.utils.checkpoint's own choice wins
            continue
        if whole:
            region = ROOT
        else:
            region = next((f.path for f in stack if any(matches(name, f) for name in names)), None)
            if region is None:
                continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
            policy = CheckpointPolicy.MUST_SAVE     # getitem inherits its parent's tag
        elif is_rng(node) or isinstance(node.meta.get("val"), torch.SymInt):
            policy = CheckpointPolicy.MUST_SAVE
        else:
            policy = CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = regions.setdefault(region, FIRST_REGION_ID + len(regions))
    return regions


def _check_names(names: Sequence[str], graph_frames: dict[fx.Node, list[Frame]]) -> None:
    seen = {f for stack in graph_frames.values() for f in stack}
    unknown = [name for name in names if name != ROOT and not any(matches(name, f) for f in seen)]
    if not unknown:
        return
    classes = sorted({f.cls for f in seen})
    paths = sorted({f.path for f in seen}, key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s)
                                                         for s in p.split(".")])
    raise RecomputeError(
        f"dynshard: recompute_modules names {', '.join(map(repr, unknown))}, which match no module of the "
        f"compiled graph. Use module class names, module paths (or a dotted suffix of one; * is a "
        f"wildcard) or ROOT for the whole program (the compiled module itself). The graph has classes: "
        f"{', '.join(classes) or 'none'}; paths: {', '.join(paths) or 'none'}")


def tag_recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Pass: recompute tags for the modules the plan recomputes (``Plan.recompute``: the config's
    ``recompute_modules`` unless the policy or a plan file chose; see the module docstring). Without names
    only user-checkpointed ops that communicate lose their recompute tag. A no-op for inference programs."""
    if not ctx.config.inference_only:
        names = ctx.plan.recompute if ctx.plan is not None else ctx.outline.recompute
        tag_graph(gm, names, _communicating_nodes(ctx))
    return gm


def tag_single_process(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """The single-process program (no passes run): lowered to ATen and tagged when recompute is asked
    for, as it is; unchanged otherwise. Lowering without decompositions keeps the ops (and numbers)
    aot_autograd would trace from the Dynamo graph itself; it lets RNG ops be recognised by their tags."""
    if not ctx.outline.recompute or ctx.config.inference_only:
        return gm
    fakes = [ctx.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    aten_gm = compat.trace_to_aten(gm, fakes, ctx.fake_mode)
    return tag_recompute(aten_gm, ctx)
