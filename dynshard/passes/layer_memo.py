"""A repeated layer whose inputs arrive as an earlier one's did computes what that one computed: propagation
replays the earlier layer's records, renamed, instead of running its ops again.

Sharding propagation is a function of the values' specs (:func:`.op_memo.value_key`). Two alike blocks
(:mod:`.repeated_blocks`: the same ops lined up, on inputs of the same shapes) whose inputs hold the same
specs when the later one starts, and whose ops carry the same activation placements (``ctx.constraints``,
position by position), give each op the same value and record the same placements, collectives,
redistributions, fallbacks, random draws and matched slices. A 32-layer transformer then propagates one
layer and replays it 31 times; every candidate of a search propagates so.

A block is run op by op, as any ops are, when it cannot be replayed exactly: its ops are not contiguous in
the graph, one of its inputs is computed after it starts, a value it reads or makes holds state a spec does
not describe (a vocabulary-parallel embedding's mask), a placement constraint of its ops names a reader
outside it, or it takes part in a vocabulary-parallel loss. A re-propagation that reuses a base
(:mod:`.propagation_reuse`) does not replay: it already runs only what changed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch.fx as fx

from .op_memo import stateless, value_key
from .repeated_blocks import find_blocks

_CACHE = "dynshard_repeated_layers"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One repetition: its ops in graph order and what they read from outside, in order of first reading."""

    group: int
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]


def repeated_layers(gm: fx.GraphModule) -> dict[fx.Node, Layer]:
    """The layers of ``gm`` that may be replayed, by their first op (found once per graph: a search propagates
    one lowered graph many times, and nothing rewrites it meanwhile)."""
    token = (len(gm.graph.nodes), id(gm.graph))
    cached = gm.meta.get(_CACHE)
    if cached is not None and cached[0] == token:
        return cached[1]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    groups: dict[Any, list] = defaultdict(list)
    for block in find_blocks(gm.graph):
        groups[(block.cls, block.signature)].append(block)
    starts = {}
    for group, members in enumerate(groups.values()):
        if len(members) < 2:
            continue
        for block in members:
            first, last = position[block.nodes[0]], position[block.nodes[-1]]
            if last - first + 1 == len(block.nodes) and all(position[i] < first for i in block.inputs):
                starts[block.nodes[0]] = Layer(group, tuple(block.nodes), tuple(block.inputs))
    gm.meta[_CACHE] = (token, starts)
    return starts


@dataclasses.dataclass
class _Recorded:
    """What propagating one layer recorded, by the position of each op (and input) in the layer."""

    layer: Layer
    collectives: list
    local_reshards: list
    placements: dict[int, Any]
    fallbacks: dict[int, str]
    replicated_constants: set[int]
    reduced_partials: set[int]
    drawn_whole: set[int]
    matched_slices: list
    placed: dict[int, Any]
    kept: dict[int, Any]


class LayerMemo:
    """Per propagation: records the first layer of each kind of inputs, and replays it for the later ones."""

    def __init__(self, layers: dict[fx.Node, Layer], excluded: set[fx.Node]):
        self.layers = {first: layer for first, layer in layers.items() if not excluded & set(layer.nodes)}
        self.seen: dict[tuple, _Recorded] = {}
        self.recording: tuple[Layer, tuple, int, int] | None = None
        self.replayed = 0

    def replays(self, node: fx.Node, interpreter) -> bool:
        """Whether ``node`` starts a layer this memo has replayed (its values are then in the interpreter's
        env, its records in its result); else, where it starts a layer, start recording it."""
        layer = self.layers.get(node)
        if layer is None or interpreter.rejoin is not None or self.recording is not None:
            return False
        key = _key(layer, interpreter)
        if key is None:
            return False
        recorded = self.seen.get((layer.group, key))
        if recorded is None:
            result = interpreter.result
            self.recording = (layer, key, len(result.collectives), len(result.local_reshards))
            return False
        _replay(recorded, layer, interpreter)
        self.replayed += 1
        return True

    def ran(self, node: fx.Node, interpreter) -> None:
        """After ``node`` ran: the end of a layer being recorded keeps what it recorded."""
        if self.recording is None or node is not self.recording[0].nodes[-1]:
            return
        layer, key, collectives, reshards = self.recording
        self.recording = None
        recorded = _record(layer, interpreter, collectives, reshards)
        if recorded is not None:
            self.seen[(layer.group, key)] = recorded


def _key(layer: Layer, interpreter) -> tuple | None:
    """What decides the layer's propagation: its inputs' specs (and the values placed for some of its ops), and
    the placement constraints of its ops, by position. None: it cannot be replayed."""
    index = {n.name: i for i, n in enumerate(layer.nodes)}
    parts: list = []
    for inp in layer.inputs:
        value = interpreter.env.get(inp)
        spec = value_key(value)
        if spec is None or not stateless(value):
            return None
        placed = interpreter.placed.get(inp)
        readers = None
        if placed is not None:
            readers = tuple(sorted(index[r] for r in interpreter.constraints[inp.name].readers if r in index))
            placed = value_key(placed)
        parts.append((spec, interpreter.result.placements.get(inp.name), placed, readers))
    for i, node in enumerate(layer.nodes):
        constraint = interpreter.constraints.get(node.name)
        if constraint is None:
            continue
        readers = constraint.readers
        if readers is not None:
            if any(r not in index for r in readers):
                return None
            readers = tuple(sorted(index[r] for r in readers))
        parts.append((i, tuple(constraint.placements), readers))
    return tuple(parts)


def _record(layer: Layer, interpreter, collectives: int, reshards: int) -> _Recorded | None:
    result, env = interpreter.result, interpreter.env
    position = {n.name: i for i, n in enumerate(layer.nodes)}
    inputs = {n.name: i for i, n in enumerate(layer.inputs)}
    if not all(stateless(env.get(n)) for n in layer.nodes):
        return None

    def where(name: str):
        """A name recorded inside the layer, by position: ("op", i), ("input", i), or itself ("": none)."""
        if name in position:
            return ("op", position[name])
        if name in inputs:
            return ("input", inputs[name])
        return ("name", name)

    ops, reshards_made = result.collectives[collectives:], result.local_reshards[reshards:]
    if any(c.node not in position for c in ops) or any(r.node not in position for r in reshards_made):
        return None
    slices = [m for m in result.matched_slices.values() if m.chain[0] in position]
    return _Recorded(
        layer, [(position[c.node], c) for c in ops],
        [(position[r.node], where(r.source), r) for r in reshards_made],
        {i: result.placements[n.name] for i, n in enumerate(layer.nodes) if n.name in result.placements},
        {position[n]: reason for n, reason in result.fallbacks.items() if n in position},
        {position[n] for n in result.replicated_constants if n in position},
        {position[n] for n in result.reduced_partials if n in position},
        {position[n] for n in result.drawn_whole if n in position},
        [(where(m.source), tuple(position[c] for c in m.chain), position[m.consumer], m) for m in slices],
        {i: interpreter.placed[n] for i, n in enumerate(layer.nodes) if n in interpreter.placed},
        {i: interpreter.kept[n] for i, n in enumerate(layer.nodes) if n in interpreter.kept})


def _replay(recorded: _Recorded, layer: Layer, interpreter) -> None:
    result, env = interpreter.result, interpreter.env
    nodes, earlier = layer.nodes, recorded.layer.nodes
    for node, same in zip(nodes, earlier):
        env[node] = env[same]

    def name(where) -> str:
        kind, value = where
        return nodes[value].name if kind == "op" else layer.inputs[value].name if kind == "input" else value

    result.collectives.extend(dataclasses.replace(c, node=nodes[i].name) for i, c in recorded.collectives)
    result.local_reshards.extend(dataclasses.replace(r, node=nodes[i].name, source=name(source))
                                 for i, source, r in recorded.local_reshards)
    result.placements.update({nodes[i].name: p for i, p in recorded.placements.items()})
    result.fallbacks.update({nodes[i].name: reason for i, reason in recorded.fallbacks.items()})
    result.replicated_constants.update(nodes[i].name for i in recorded.replicated_constants)
    result.reduced_partials.update(nodes[i].name for i in recorded.reduced_partials)
    result.drawn_whole.update(nodes[i].name for i in recorded.drawn_whole)
    for source, chain, consumer, matched in recorded.matched_slices:
        renamed = dataclasses.replace(matched, source=name(source), chain=tuple(nodes[i].name for i in chain),
                                      consumer=nodes[consumer].name)
        result.matched_slices[renamed.chain[0]] = renamed
    interpreter.placed.update({nodes[i]: value for i, value in recorded.placed.items()})
    interpreter.kept.update({nodes[i]: value for i, value in recorded.kept.items()})
