"""Compile the per-rank program (aot_autograd + Inductor or aot_eager) and read back what it runs."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .. import compat
from ..passes.outline_repeated_blocks import unalias_subgraph_outputs
from ..runtime.mesh import Layout
from .compiler import compile_per_rank


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective in a compiled per-rank graph."""

    phase: str        # "forward", "backward" or "inference"
    kind: str         # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    group: str        # mesh dimension ("dp", "tp") or process group name
    bytes: int
    shape: tuple[int, ...]
    region: str = ""  # the outlined block whose code issues it (once per call); "" for the program's own


def collectives_in(graph: fx.GraphModule, phase: str, layout: Layout, region: str = "") -> list[CollectiveRecord]:
    records = []
    for node in graph.graph.nodes:
        if node.target is compat.invoke_subgraph:      # a repeated block: its collectives, once per call
            body = getattr(graph, node.args[0].target)
            # the block's name: the call's identifier, which aot_autograd's partitioning turns into
            # "partitioned_fw_<name>_<n>" (and "..._bw_...")
            partitioned = re.fullmatch(r"partitioned_[fb]w_(.+)_\d+", str(node.args[1]))
            name = partitioned.group(1) if partitioned else str(node.args[1])
            records.extend(collectives_in(body, phase, layout, region=name))
            continue
        kind = compat.COLLECTIVE_KINDS.get(node.target)
        if kind is None:
            continue
        tensors = [v for v in (node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None,
                               node.meta.get("val")) if isinstance(v, torch.Tensor)]
        largest = max(tensors, key=lambda t: t.numel()) if tensors else None
        group_name = node.args[-1] if isinstance(node.args[-1], str) else str(node.kwargs.get("group_name"))
        records.append(CollectiveRecord(
            phase=phase, kind=kind, group=layout.group_dim(group_name),
            # (sizes computed by a collective's fake kernel can be SymInts: counted at their hints, which
            # adds no guard to the frame)
            bytes=compat.size_hint(largest.numel()) * largest.element_size() if largest is not None else 0,
            shape=tuple(compat.size_hint(size) for size in largest.shape) if largest is not None else (),
            region=region))
    return records


def program_code(graph: fx.GraphModule) -> str:
    """A graph's code, then the code of each repeated block it calls (once, with how often)."""
    calls: dict[str, int] = {}
    for node in graph.graph.find_nodes(op="call_function", target=compat.invoke_subgraph):
        calls[node.args[0].target] = calls.get(node.args[0].target, 0) + 1
    return graph.code + "".join(f"\n# {name}, called {count} times{getattr(graph, name).code}"
                                for name, count in calls.items())


def saved_activations(backward: fx.GraphModule, forward_storages: set) -> tuple[int, int]:
    """(bytes, tensors) the forward keeps alive for the backward: the backward graph's placeholders that
    are not tangents, counted once per storage (views of one tensor share it), without the storages of
    the forward's inputs (a parameter, or a view of one, saved for its matmul costs no memory).

    A storage is counted as many times as it is saved as the same view: every call of an outlined block
    (``invoke_subgraph``) answers with the same fake outputs (torch caches them by the call's inputs), so
    the values each call saves share their fake storages; two placeholders of one view are two tensors
    (the partitioner saves a tensor once)."""
    views: dict = defaultdict(Counter)
    sizes = {}
    for node in backward.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if storage not in forward_storages:
            views[storage][str((value.storage_offset(), tuple(value.shape), value.stride()))] += 1   # (SymInts)
            sizes[storage] = compat.size_hint(value.untyped_storage().nbytes())     # (no guard on a SymInt)
    copies = {storage: max(seen.values()) for storage, seen in views.items()}
    return sum(sizes[s] * n for s, n in copies.items()), sum(copies.values())


def _input_storages(forward: fx.GraphModule) -> set:
    return {StorageWeakRef(n.meta["val"].untyped_storage()) for n in forward.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}


@dataclasses.dataclass
class CompiledProgram:
    run: Any
    collectives: list[CollectiveRecord]
    graphs: dict[str, str]        # phase -> code of the graph handed to the compiler
    seconds: float
    saved_bytes: int = 0          # activations the forward keeps for the backward, on this rank
    saved_count: int = 0          # ... in this many tensors (distinct storages)
    split_outputs: dict = dataclasses.field(default_factory=dict)  # output -> DTensor spec (gather_outputs=False)
    outlined: list = dataclasses.field(default_factory=list)       # repeated blocks compiled once: (class, calls)
    forward_storages: set = dataclasses.field(default_factory=set, repr=False)
    # called with a phase once its collectives are recorded (a backward compiled at its first call: then)
    on_collectives: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)
    symbolic: bool = False        # compiled on symbolic sizes: one program for every size of its family


def compile_program(gm: fx.GraphModule, local_inputs: Sequence[torch.Tensor], compiler: str, layout: Layout,
                    inference_only: bool = False, freeze: bool = False, partition_pass=None,
                    inductor_patches: dict | None = None, backward=None, blocks_only: bool = False,
                    share_traces: bool | None = None, symbolic: bool = False) -> CompiledProgram:
    """``partition_pass``: run on each joint graph right before it is partitioned (the program's and each
    outlined block's: ZeRO-3's recompute tags);
    ``inductor_patches``: Inductor settings for this program (collective bucketing); ``backward``: compiles
    the backward graph instead (:mod:`.split_backward`); ``blocks_only``: Inductor compiles the outlined
    blocks, the program around them runs as traced (``Config.compile_scope="blocks"``); ``share_traces``:
    ``Config.share_traces``; ``symbolic``: ``local_inputs`` hold symbolic sizes (see compiler.compile_per_rank)."""
    program = CompiledProgram(run=None, collectives=[], graphs={}, seconds=0.0, symbolic=symbolic)

    def on_graph(graph: fx.GraphModule, phase: str) -> None:
        unalias_subgraph_outputs(graph)
        program.graphs[phase] = program_code(graph)
        program.collectives = [c for c in program.collectives if c.phase != phase]
        program.collectives.extend(collectives_in(graph, phase, layout))
        if phase == "forward":
            program.forward_storages = _input_storages(graph)
        elif phase == "backward":
            program.saved_bytes, program.saved_count = saved_activations(graph, program.forward_storages)
            program.forward_storages = set()
        if program.on_collectives is not None:
            program.on_collectives(phase)

    def keep() -> dict:
        return {"graphs": program.graphs, "collectives": program.collectives, "saved_bytes": program.saved_bytes,
                "saved_count": program.saved_count}

    def recall(kept: dict) -> None:
        """A program read from aot_autograd's cache: what ``on_graph`` saw when it was compiled (by this
        rank or another rank of the same program: its graphs show that rank's process-group names)."""
        program.graphs, program.collectives = dict(kept["graphs"]), list(kept["collectives"])
        program.saved_bytes, program.saved_count = kept["saved_bytes"], kept["saved_count"]

    def joint_passes(joint: fx.GraphModule, joint_inputs) -> fx.GraphModule:
        # an outlined block's saved input read from the input itself: the partitioner then sees what
        # it is (a ZeRO-3 gather it recomputes in the backward rather than keeps) and Inductor its lifetime
        unalias_subgraph_outputs(joint)
        return joint

    start = time.perf_counter()
    if inference_only:
        with torch.no_grad():
            program.run = compile_per_rank(gm, local_inputs, compiler, on_graph, freeze=freeze,
                                           patches=inductor_patches, blocks_only=blocks_only,
                                           records=(keep, recall), share_traces=share_traces, symbolic=symbolic)
    else:
        program.run = compile_per_rank(gm, local_inputs, compiler, on_graph, joint_pass=joint_passes,
                                       partition_pass=partition_pass, patches=inductor_patches,
                                       backward=backward, blocks_only=blocks_only, records=(keep, recall),
                                       share_traces=share_traces, symbolic=symbolic)
    program.seconds = time.perf_counter() - start
    return program
