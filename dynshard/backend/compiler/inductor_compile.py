"""How dynshard compiles each rank's program: aot_autograd, then Inductor (or aot_eager), with dynshard's
Inductor settings, its cache policy (:mod:`.cached_compile`, :mod:`.shared_compiles`), its kernel batches
and the blocks-only scope. Torch's private pieces are reached through :mod:`dynshard.compat`."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ... import compat
from ...compat import aot_autograd, inductor
from . import cache_names
from .block_schemas import block_schemas_memoized
from .blocks_only import compile_blocks_only
from .cached_compile import CacheUse, compile_cached, remember
from .cpu_isa_probe import wait_cpu_isa_probe
from .gather_merge import gather_buckets_copied_out
from .kernel_batches import cpp_kernels_batched
from .shared_compiles import compile_shared, rank_free_compiles, traces_shared


def compile_per_rank(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: str,
                     on_graph: Callable[[fx.GraphModule, str], None], freeze: bool = False,
                     joint_pass: Callable | None = None, patches: dict | None = None,
                     backward: Callable | None = None, partition_pass: Callable | None = None,
                     blocks_only: bool = False, records: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                     share_traces: bool | None = None, symbolic: bool = False):
    """aot_autograd + the configured compiler; ``on_graph(graph, phase)`` sees each forward/backward
    graph (phase "forward", "backward" or "inference") before it is compiled. ``joint_pass(joint,
    inputs)`` runs on the joint graph before it is partitioned (functorch's ``joint_custom_pass``);
    ``patches`` are Inductor settings. The result is called as ``run(*args)`` (aot_module_simplified's
    convention, whatever ``_boxed_call`` it copies). ``backward(graph, inputs, compile_graph)`` replaces
    the backward's compilation: it returns the boxed backward, compiling graphs with ``compile_graph``.
    ``partition_pass(joint)`` runs right before each partitioner call: on the program's joint graph and
    on each outlined block's, which aot_autograd partitions before ``joint_pass`` runs. ``blocks_only``:
    Inductor compiles the outlined blocks of a graph that has some, and the graph itself runs as traced
    (:func:`.blocks_only.compile_blocks_only`). ``records``: ``(keep, recall)``, what ``on_graph`` learned
    (``keep()``, picklable) and how to restore it (``recall(kept)``): with them, aot_autograd's cache serves
    the program where it can (:func:`.cached_compile.compile_cached`), and ``recall`` replaces ``on_graph``
    on a hit; ``share_traces``: ``Config.share_traces``. ``symbolic``: the inputs are fakes of Dynamo's mode
    with symbolic sizes (:func:`dynshard.backend.plan_and_compile.symbolic_examples`), compiled in Dynamo's
    tracing context, so that the guards the compile adds on those sizes become the frame's."""
    joint = aot_autograd.settings(joint_custom_pass=joint_pass) if joint_pass else contextlib.nullcontext()
    fake_mode = None
    if compiler != "aot_eager" and not freeze and not symbolic:     # (freezing reads the real parameters)
        fake_mode, example_inputs = compat.cacheable_fake_mode(example_inputs)
    tracing = compat.local_random_ops() if symbolic else compat.isolated_tracing(fake_mode)
    with tracing, joint, block_schemas_memoized(), compat.mask_offsets_read_at_run_time():
        if compiler == "aot_eager":
            def recorder(phase_if_training: str):
                def compile_graph(graph: fx.GraphModule, inputs):
                    on_graph(graph, phase_if_training)
                    if phase_if_training == "backward" and backward is not None:
                        return backward(graph, inputs, aot_autograd.boxed_nop)
                    return aot_autograd.boxed_nop(graph, inputs)
                return compile_graph

            partition = {} if partition_pass is None else {
                "partition_fn": _partition_after(partition_pass, aot_autograd.default_partition)}
            backend = aot_autograd.aot_autograd_backend(fw_compiler=recorder("forward"),
                                                        bw_compiler=recorder("backward"),
                                                        inference_compiler=recorder("inference"), **partition)
            return backend(gm, list(example_inputs))

        use = CacheUse()
        # registers the bucketing custom ops, which programs loaded from Inductor's cache call
        inductor.register_bucketing_ops()
        # a cacheable compile: one rank of the host compiles each distinct graph, the others read it
        compile_inductor = (inductor.compile_fx_inner if fake_mode is None
                            else functools.partial(compile_shared, inductor.compile_fx_inner))

        def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
            wait_cpu_isa_probe()
            with gather_buckets_copied_out(), cpp_kernels_batched():    # the backward too: compiled
                return _inner_compile(graph, inputs, **kwargs)                      # here, at its first call

        def _inner_compile(graph: fx.GraphModule, inputs, **kwargs):
            if kwargs.get("is_backward"):
                phase = "backward"
            elif kwargs.get("is_inference"):
                phase = "inference"
            else:
                phase = "forward"
            on_graph(graph, phase)
            use.traced = True
            if phase == "backward" and use.unrecorded_backward:     # compiled at its first call: records again
                remember(use.unrecorded_backward, records[0]())
                use.unrecorded_backward = None

            def compile_graph(part: fx.GraphModule, part_inputs):
                if blocks_only and any(node.target is compat.invoke_subgraph for node in part.graph.nodes):
                    return compile_blocks_only(part, phase, compile_inductor)
                return compile_inductor(part, part_inputs, **kwargs)

            if phase == "backward" and backward is not None:
                return backward(graph, inputs, compile_graph)
            return compile_graph(graph, inputs)

        # independent all-reduces (data-parallel gradients) go out in buckets, as DDP's reducer does
        # (one bucket measured faster than DDP's 1 MB + 25 MB on CPU/gloo: benchmarks/bench_gpt.py)
        patches = {"bucket_all_reduces_fx": "all", **(patches or {}), **({"freezing": True} if freeze else {})}
        patches["post_grad_custom_pre_pass"] = _marked_dynshards(inductor.setting("post_grad_custom_pre_pass"))
        if partition_pass is not None:
            patches["custom_partitioner_fn"] = _partition_after(partition_pass)
        if any(node.target is compat.invoke_subgraph for node in gm.graph.nodes) and not blocks_only:
            # torch 2.13: around an invoke_subgraph call Inductor reuses buffers that are still live
            # (wrong gradients, exact loss; see passes/outline_repeated_blocks.py): allocate instead
            # (blocks_only: Inductor compiles each block alone, no call inside what it compiles)
            patches["allow_buffer_reuse"] = False

        def compile_now():
            return inductor.compile_fx(gm, list(example_inputs), inner_compile=inner_compile, config_patches=patches)

        with inductor.settings(patches):     # (whether compiles are rank-free depends on them)
            # (a split backward and Inductor's blocks alone are compiled where aot_autograd cannot save
            # them; compiled autograd would run the entry's backward graph, which names the tracing rank's
            # groups)
            cached = (fake_mode is not None and backward is None and not blocks_only and records is not None
                      and not inductor.compiled_autograd_on() and cache_names.program_functions_named(gm))
            shared = cached and traces_shared(share_traces) and rank_free_compiles()
        if not cached:
            with aot_autograd.settings(enable_autograd_cache=False):
                return compile_now()
        return compile_cached(gm, example_inputs, compile_now, *records, shared, use)


class _DynshardCompile(compat.CustomGraphPass):
    """Does nothing; in every dynshard compile's Inductor settings so that its FX graph cache entries are
    its own: a cached program calls ``dynshard::copy_out_gathered`` where Inductor's bucketing would copy
    parameters out itself, and gathers out of place (:func:`.gather_merge.gather_buckets_copied_out`)."""

    def __call__(self, graph: fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        # where a compile may bake the rank in (GPU overlap scheduling), each rank keeps its own entries
        rank = "" if rank_free_compiles() or not torch.distributed.is_initialized() else \
            f", rank {torch.distributed.get_rank()}"
        return (f"dynshard {cache_names.dynshard_source_digest()}: copy_out_gathered bucket merge, "
                f"rank-free gathers{rank}")


_DYNSHARD_COMPILE = _DynshardCompile()


def _marked_dynshards(user_passes) -> Any:
    """The post-grad passes the user set (they still run, and key the cache as Inductor keys them),
    then dynshard's mark."""
    if not user_passes:
        return _DYNSHARD_COMPILE
    return [*(user_passes if isinstance(user_passes, (list, tuple)) else [user_passes]), _DYNSHARD_COMPILE]


def _partition_after(before: Callable[[fx.GraphModule], Any], partitioner: Callable | None = None):
    """A partitioner that runs ``before(joint)`` first: Inductor's ``custom_partitioner_fn`` (min-cut),
    or aot_autograd's ``partition_fn`` (``partitioner``). Either is also what aot_autograd partitions an
    ``invoke_subgraph``'s joint graph with, which is why dynshard's joint tags are set here."""
    class PartitionAfter(compat.CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
            before(gm)
            return (partitioner or aot_autograd.min_cut_partition)(gm, joint_inputs, **kwargs)

        def uuid(self) -> str | None:
            try:       # what the tagging does, as the key of what it tags (None: Inductor bypasses its cache)
                return f"dynshard: partition after tagging {cache_names.state_digest(before)}"
            except Exception:
                return None

        def __reduce__(self):
            # pickled only into the cache key of Inductor's FX graph cache (its settings), whose graph is
            # the partitioned one: what the partitioner did is hashed with it
            return (str, (self.uuid(),))
    return PartitionAfter()
