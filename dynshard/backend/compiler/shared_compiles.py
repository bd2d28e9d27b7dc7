"""The ranks on one host compile each distinct program once; the others read it from Inductor's cache.

Every rank of a job compiles its own program, and most ranks' programs are the same ones: a data-parallel
group's ranks hold the same shards, and with the mesh coordinate read at run time
(:mod:`dynshard.compat.mesh_coordinate`) so do the ranks of a tensor-parallel group, up to the names of
their process groups. Two things make each distinct program one Inductor compile per host:

- **Groups named by their shape** (:func:`groups_named_by_shape`). A functional collective names its
  process group, and groups of one mesh dimension have different names on different ranks ("1" for ranks
  {0, 1}, "2" for {2, 3}). Before Inductor sees a graph, each group name is replaced by an alias that says
  which ranks the group holds relative to its first ("dynshard:0,2": every second rank), registered on this
  rank for its own group (``_register_process_group``; names are looked up where each rank runs, never sent).
  Nothing Inductor generates may then depend on the rank's place in a group, or a rank would run another
  rank's code: the bucketed all-gathers do not (:mod:`.gather_merge`), the vocabulary masks
  read the coordinate at run time.
- **One compile at a time per distinct graph** (:func:`compiled_once_per_host`). Ranks reach a graph at
  the same moment, so all of them would miss the cache and compile. A file lock named by the graph's code
  and inputs (in Inductor's cache directory, so shared by the ranks that share the cache) lets the first
  compile it and write the cache entry, which the others then read. The lock only orders the work: what
  a rank runs is still what Inductor's own key finds, and a graph that hashes differently is compiled.
  A graph the cache bypasses (something in it Inductor cannot key) is marked so, and the ranks then
  compile it side by side rather than one after another.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ... import compat
from ...compat import aot_autograd, inductor

ALIAS_PREFIX = "dynshard:"
LOCK_TIMEOUT_S = 600      # then a rank compiles the graph itself: a compile that long is no hang to wait on

log = logging.getLogger("dynshard")


def groups_named_by_shape(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` (and the graphs it calls) with every ``group_name`` argument of an op replaced by its
    alias, registered for this rank's group."""
    for module in graph.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, compat.OpOverload):
                continue
            for index, argument in enumerate(node.target._schema.arguments):
                if argument.name != "group_name":
                    continue
                positional = index < len(node.args)
                name = node.args[index] if positional else node.kwargs.get("group_name")
                alias = group_alias(name) if isinstance(name, str) else name
                if alias == name:
                    continue
                if positional:
                    node.update_arg(index, alias)
                else:
                    node.update_kwarg("group_name", alias)
                changed = True
        if changed:
            module.recompile()
    return graph


def group_alias(group_name: str) -> str:
    """The name of the group ``group_name`` by the ranks it holds relative to its first, registered on
    this rank (a second group of the same shape on this rank gets "#1", and so on). The name itself when
    it is an alias already or names no group."""
    if group_name.startswith(ALIAS_PREFIX):
        return group_name
    group = compat.resolve_process_group(group_name)
    if group is None:
        return group_name
    ranks = sorted(torch.distributed.get_process_group_ranks(group))
    base = ALIAS_PREFIX + ",".join(str(rank - ranks[0]) for rank in ranks)
    for copy in range(len(ranks) + 16):
        alias = base if copy == 0 else f"{base}#{copy}"
        registered = compat.resolve_process_group(alias)
        if registered is None:      # free, or left by a destroyed group (c10d keeps the name)
            compat.register_process_group_name(alias, group)
            return alias
        if registered is group:
            return alias
    return group_name


def rank_free_compiles() -> bool:
    """Whether Inductor's settings let ranks share compiles: False where a compile runs collectives (GPU
    overlap scheduling aligns its estimates across ranks and times collectives, distributed autotuning,
    the SPMD check: a rank holding the lock would wait for ranks that wait for it) or bakes the rank into
    the code (overlap scheduling buckets gathers with Inductor's in-place merge)."""
    distributed = "aten_distributed_optimizations."     # (spmd_check: torch 2.13; absent before)
    return not (inductor.setting(distributed + "enable_overlap_scheduling")
                or inductor.setting(distributed + "spmd_check", False)
                or inductor.setting("distributed_max_autotune_gemm"))


def _cache_on(cache: str) -> bool:
    if torch.compiler.config.force_disable_caches:
        return False
    if cache == "aot_autograd":
        return aot_autograd.setting("enable_autograd_cache")
    return inductor.setting("fx_graph_cache")


_BYPASS_COUNTERS = {"inductor": ("inductor", "fxgraph_cache_bypass"),
                    "aot_autograd": ("aot_autograd", "autograd_cache_bypass")}


def compiled_once_per_host(graph: fx.GraphModule, inputs: Sequence[Any], compile_now: Callable[[], Any],
                           cache: str = "inductor") -> Any:
    """``compile_now()`` under a lock named by ``graph``: the other ranks of this host (those sharing
    Inductor's cache directory) wait to compile a graph of the same code and inputs, and then read the
    entry this compile wrote in ``cache`` (Inductor's FX graph cache, or "aot_autograd"'s). Nothing is
    held where that cache is off, and the waiting ends for all once a compile of the graph bypassed the
    cache (a mark beside the lock): the ranks then compile it side by side, as without the lock."""
    from filelock import FileLock, Timeout      # (a dependency of torch)

    if not _cache_on(cache):
        return compile_now()
    group, counter = _BYPASS_COUNTERS[cache]
    directory = os.path.join(inductor.cache_dir(), "dynshard_compiles")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, graph_digest(graph, inputs))
    if os.path.exists(f"{path}.bypassed"):
        return compile_now()
    lock = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:
        log.warning("dynshard: another rank has compiled this graph for %d s; compiling it here too", LOCK_TIMEOUT_S)
        return compile_now()
    try:
        if os.path.exists(f"{path}.bypassed"):      # (written while this rank waited)
            lock.release()
            return compile_now()
        bypassed = inductor.counter(group, counter)
        compiled = compile_now()
        if inductor.counter(group, counter) > bypassed:
            open(f"{path}.bypassed", "w").close()
        return compiled
    finally:
        if lock.is_locked:
            lock.release()


def graph_digest(graph: fx.GraphModule, inputs: Sequence[Any]) -> str:
    """A digest of the code of ``graph`` and of the graphs it calls, and of its inputs' metadata."""
    parts = [module.code for module in graph.modules() if isinstance(module, fx.GraphModule)]
    for value in inputs:
        if isinstance(value, torch.Tensor):
            parts.append(f"{value.dtype} {value.device} {tuple(value.shape)} {value.stride()} "
                         f"{value.requires_grad}")
        else:
            parts.append(repr(value))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def compile_shared(compile: Callable[..., Any], graph: fx.GraphModule, inputs: Sequence[Any], **kwargs):
    """``compile(graph, inputs, **kwargs)`` with the groups named by shape, one rank of this host at a time
    (as it is where Inductor's settings do not let ranks share compiles)."""
    if not rank_free_compiles():
        return compile(graph, inputs, **kwargs)
    groups_named_by_shape(graph)
    return compiled_once_per_host(graph, inputs, lambda: compile(graph, inputs, **kwargs))


def traces_shared(setting: bool | None) -> bool:
    """``Config.share_traces``: None decides by this host, whose ranks share one cache directory
    (``LOCAL_WORLD_SIZE``, torchrun's; else the world) against the cores this process may run on."""
    if setting is not None:
        return setting
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not ranks:
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return ranks > cores
