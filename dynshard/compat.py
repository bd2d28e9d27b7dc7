"""Every use of a private PyTorch API in dynshard goes through this module.

A torch upgrade that moves one of these should only ever need an edit here. Each helper names the
private piece it wraps.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

_c10d = torch.ops._c10d_functional

# Functional collectives as they appear in traced graphs, by the name dynshard reports them under.
COLLECTIVE_KINDS: dict[Any, str] = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_reduce_.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
}
if hasattr(_c10d, "all_reduce_coalesced"):
    COLLECTIVE_KINDS[_c10d.all_reduce_coalesced.default] = "all_reduce"


def register_logger(name: str) -> None:
    """Make ``TORCH_LOGS=dynshard`` switch dynshard's logger on (torch._logging registry)."""
    from torch._logging._internal import log_registry, register_log

    if name not in log_registry.log_alias_to_log_qnames:
        register_log(name, name)


def grapharg_source_name(node: fx.Node) -> str | None:
    """Dynamo's source for a placeholder, e.g. ``L['self']._modules['fc']._parameters['weight']``."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name


def drop_guards_on(node: fx.Node) -> None:
    """Remove Dynamo's guards on a graph input (its TENSOR_MATCH on size/stride among them).

    Used for parameters that dynshard shards in place: their local shape at run time differs from the
    global shape Dynamo traced, by design, and must not trigger a re-trace.
    """
    from torch._guards import TracingContext

    grapharg = node.meta.get("grapharg")
    context = TracingContext.try_get()
    if grapharg is None or context is None:
        return
    context.guards_context.dynamo_guards.remove_guards_with_source(grapharg.source)


_COMPILE_HOOKS: set[int] = set()


def around_dynamo_compiles(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Run ``start()`` before Dynamo traces any frame and ``end()`` after it has compiled it."""
    if id(start) in _COMPILE_HOOKS:
        return
    _COMPILE_HOOKS.add(id(start))
    torch._dynamo.callback_handler.register_start_callback(lambda _args: start())
    torch._dynamo.callback_handler.register_end_callback(lambda _args: end())


def keep_shapes_static() -> None:
    """dynshard plans static shapes: a new batch size recompiles instead of going symbolic."""
    torch._dynamo.config.automatic_dynamic_shapes = False


def new_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def isolated_tracing(fake_mode=None) -> Iterator[None]:
    """Run nested tracing/compiling inside a Dynamo backend call without touching Dynamo's context."""
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(fake_mode or new_fake_mode())):
        yield


def trace_to_aten(gm: fx.GraphModule, fake_inputs: Sequence[Any], fake_mode,
                  decompositions: dict | None = None) -> fx.GraphModule:
    """Lower a Dynamo graph to ATen ops with FakeTensor metadata (``make_fx``), keeping each node's
    source line (``stack_trace``) from the Dynamo graph."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    # functionalized: an in-place update of a buffer (BatchNorm's running stats) becomes a value and a
    # final copy_ into the buffer, which DTensor can place; an in-place op on a re-sharded copy of a
    # buffer would be lost
    functional = torch.func.functionalize(run, remove="mutations")
    with isolated_tracing(fake_mode), fake_mode, fx_traceback.preserve_node_meta():
        return make_fx(functional, decomposition_table=decompositions or {}, tracing_mode="real")(*fake_inputs)


def dtensor_redistributions(op, args: tuple, kwargs: dict):
    """What DTensor's dispatcher will do for ``op(*args, **kwargs)``: one (current_spec, needed_spec)
    per DTensor positional argument, in order; [] when nothing is redistributed.

    Raises NotImplementedError when DTensor has no sharding strategy for the op.
    """
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    # the cached entry point: planning runs under FakeTensorMode, where DTensor itself would bypass
    # its cache ("tracing"); static shapes make every schema hashable
    sharding = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
    if not sharding.needs_redistribute or sharding.redistribute_schema is None:
        return []
    return list(zip(info.schema.args_spec, sharding.redistribute_schema.args_spec))


def has_sharding_strategy(op, direct_only: bool = False) -> bool:
    """Whether DTensor can shard ``op``: a strategy of its own, a custom handler or (unless
    ``direct_only``) DTensor's decomposition-based strategy."""
    from torch.distributed.tensor import DTensor

    if not isinstance(op, torch._ops.OpOverload):
        return True
    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    if op in dispatcher._custom_op_handlers or op in prop.op_strategy_funcs:
        return True
    if op in getattr(prop, "op_single_dim_strategy_funcs", {}) or op in getattr(prop, "op_to_rules", {}):
        return True
    if direct_only:
        return False
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    return DecompShardingStrategy.has_decomp(op)


def compile_per_rank(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: str,
                     on_graph: Callable[[fx.GraphModule, str], None], freeze: bool = False):
    """aot_autograd + the configured compiler; ``on_graph(graph, phase)`` sees each forward/backward
    graph (phase "forward", "backward" or "inference") before it is compiled. The result is called
    as ``run(*args)`` (aot_module_simplified's convention, whatever ``_boxed_call`` it copies)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    with isolated_tracing():
        if compiler == "aot_eager":
            def recorder(phase_if_training: str):
                def compile_graph(graph: fx.GraphModule, inputs):
                    on_graph(graph, phase_if_training)
                    return boxed_nop(graph, inputs)
                return compile_graph

            backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"),
                                   inference_compiler=recorder("inference"))
            return backend(gm, list(example_inputs))

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
            if kwargs.get("is_backward"):
                phase = "backward"
            elif kwargs.get("is_inference"):
                phase = "inference"
            else:
                phase = "forward"
            on_graph(graph, phase)
            return compile_fx_inner(graph, inputs, **kwargs)

        # independent all-reduces (data-parallel gradients) go out in buckets, as DDP's reducer does
        # (one bucket measured faster than DDP's 1 MB + 25 MB on CPU/gloo: benchmarks/bench_gpt.py)
        patches = {"bucket_all_reduces_fx": "all", **({"freezing": True} if freeze else {})}
        return compile_fx(gm, list(example_inputs), inner_compile=inner_compile, config_patches=patches)


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group that never communicates, for pass-level tests in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)



_DECOMPOSITIONS: dict | None = None


def _contiguous_output(decomposition):
    """The CPU flash-attention kernel returns a contiguous output, but its decomposition lays the output
    out as the CUDA kernel does ((L, N, H, E) in memory); user code that ``view``s after a transpose
    relies on the kernel's strides, so keep them."""
    def run(*args, **kwargs):
        output, *rest = decomposition(*args, **kwargs)
        return (output.contiguous(), *rest)
    return run


def sharding_decompositions() -> dict:
    """ATen decompositions for the ops DTensor cannot shard (e.g. CPU flash attention), so that
    tracing lowers them to ops it can; ops DTensor shards directly are kept whole."""
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        from torch._decomp import core_aten_decompositions

        _DECOMPOSITIONS = {op: fn for op, fn in core_aten_decompositions().items()
                           if isinstance(op, torch._ops.OpOverload) and not has_sharding_strategy(op, direct_only=True)}
        # native_batch_norm updates its running statistics in place without saying so in its schema;
        # decomposed, the update becomes a visible (functionalized) copy into the buffer
        from torch._decomp import decomposition_table

        batch_norm = torch.ops.aten.native_batch_norm.default
        if batch_norm in decomposition_table:
            _DECOMPOSITIONS[batch_norm] = decomposition_table[batch_norm]
        sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        if sdpa_cpu in _DECOMPOSITIONS:
            _DECOMPOSITIONS[sdpa_cpu] = _contiguous_output(_DECOMPOSITIONS[sdpa_cpu])
    return _DECOMPOSITIONS
