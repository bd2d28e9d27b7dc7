"""Every use of a private PyTorch API in dynshard goes through this package (this module and its
submodules, whose names it re-exports: :mod:`.ops`, :mod:`.tracing`, :mod:`.symbolic`, ...; the shims
dynshard's compile driver calls, :mod:`.inductor`, :mod:`.aot_autograd`, :mod:`.cpp_kernels` and
:mod:`.cpu_isa`, are imported as modules).

A torch upgrade that moves one of these should only ever need an edit here. Each helper names the
private piece it wraps; what dynshard decides with it (which ops to decompose, which strategies to register,
retries, memos, messages) lives in a later package.

The submodules import what they share from each other (:mod:`.ops`, :mod:`.tracing`), never from this
package, which imports them: the package's imports run one way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
# private torch names used across dynshard, under public names here
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn  # noqa: F401
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode as FakeMode  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.utils import _pytree as pytree  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._python_dispatch import _disable_current_modes as outside_dispatch_modes  # noqa: F401

# how each rank's program is compiled
from .mask_partial import is_mask_partial, mask_offsets_read_at_run_time  # noqa: F401
from .ops import (ALL_GATHER, COLLECTIVE_KINDS, all_gather_rows, all_reduce, all_to_all_rows, group_rank,  # noqa: F401
                  invoke_subgraph, process_group_names, reduce_scatter_rows, register_process_group_name, resolve_process_group)
from .frames import compiling_frame, dynamo_frame_id  # noqa: F401
from .recompile_limit import on_recompile_limit  # noqa: F401
from .symbolic import (dtensor_symbolic_tracing, dynamo_fake_mode, dynamo_tracing_context, guards_left_out,  # noqa: F401
                       size_hint, sizes_key, specialize_floats, static_fake, symbolic_dims, traced_in)
from .tracing import (cacheable_fake_mode, fake_tensor_log_quiet, isolated_tracing, local_random_ops,  # noqa: F401
                      new_fake_mode, on_symbols, trace_to_aten)


def register_logger(name: str) -> None:
    """Make ``TORCH_LOGS=dynshard`` switch dynshard's logger on (torch._logging registry)."""
    from torch._logging._internal import log_registry, register_log

    if name not in log_registry.log_alias_to_log_qnames:
        register_log(name, name)


def trace_artifact(name: str, payload: Callable[[], str]) -> None:
    """A text artifact in torch's structured trace (``TORCH_TRACE=dir``, which tlparse reads); ``payload`` is
    called only while a trace is written."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload)


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


def in_optimized_module() -> bool:
    """Whether a ``torch.compile(module)`` wrapper's call is running: that wrapped module's own hooks run
    there outside Dynamo, before its compiled frame (``OptimizedModule._initialize``)."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    return _is_in_optimized_module()


def compiling_backend() -> Callable | None:
    """The backend Dynamo is compiling the current frame for, as given to ``torch.compile`` (the
    function behind a backend name, ``torch._TorchCompileWrapper`` and ``functools.partial`` unwrapped);
    None outside a Dynamo compile or when it cannot be found."""
    frame = compiling_frame()
    backend = frame.get("compiler_fn") if frame is not None else None
    return _unwrap_backend(backend) if backend is not None else None


def backend_options(compiler_fn: Any) -> Any:
    """The ``options=`` torch.compile was given with the backend ``compiler_fn`` (None if none)."""
    import functools

    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(compiler_fn)
    options = getattr(backend, "kwargs", {}).get("options")
    backend = getattr(backend, "compiler_fn", backend)
    while isinstance(backend, functools.partial):
        options = backend.keywords.get("options", options)
        backend = backend.func
    return options


def _unwrap_backend(backend: Callable) -> Callable:
    """The function behind a Dynamo backend: DDPOptimizer's ``compile_fn`` (a frame compiled inside
    DistributedDataParallel's forward), torch.compile's wrapper and ``functools.partial`` unwrapped."""
    import functools

    from torch._dynamo.eval_frame import innermost_backend

    backend = getattr(getattr(backend, "__self__", None), "backend_compile_fn", backend)   # DDPOptimizer
    backend = innermost_backend(backend)
    backend = getattr(backend, "compiler_fn", backend)   # torch.compile's _TorchCompileWrapper
    while isinstance(backend, functools.partial):
        backend = backend.func
    return backend


def module_backend(module: torch.nn.Module) -> Callable | None:
    """The backend a module was compiled with (``torch.compile(module)``'s wrapper, or a module compiled
    in place with ``module.compile()``); None if it is not compiled or Dynamo's objects are not where
    they are expected."""
    from torch._dynamo.eval_frame import OptimizedModule

    try:
        if isinstance(module, OptimizedModule):
            callback = module.dynamo_ctx.callback
        else:   # nn.Module.compile(): the context's callback is a free variable of the compiled _call_impl
            compiled = getattr(module, "_compiled_call_impl", None)
            cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__ or ())) if compiled else {}
            if "callback" not in cells:
                return None
            callback = cells["callback"].cell_contents
        return _unwrap_backend(callback)
    except (AttributeError, TypeError, ValueError):
        return None


def module_backend_options(module: torch.nn.Module) -> Any:
    """The ``options=`` of ``torch.compile(module, backend=..., options=...)`` (None if none or not compiled)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, OptimizedModule):
        return None
    try:
        return backend_options(module.dynamo_ctx.callback)
    except AttributeError:
        return None


def registered_backend(name: str) -> Callable | None:
    """The function ``torch.compile(backend=name)`` runs, from Dynamo's backend registry (an entry point of
    ``torch_dynamo_backends``, such as dynshard's own, is loaded at its first look-up); None when no backend
    has that name. Lets a module recognise a backend without importing the module that defines it."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        return lookup_backend(name)
    except InvalidBackend:
        return None


def register_compile_start(callback: Callable[[Any], None]) -> None:
    """Register ``callback(args)`` with Dynamo's start-of-compile callbacks (``torch._dynamo.callback_handler``)
    unless it is there; ``torch._dynamo.reset()`` drops them: call this again and it is registered again."""
    handler = torch._dynamo.callback_handler
    if callback not in handler.start_callbacks:
        handler.register_start_callback(callback)


def register_compile_end(callback: Callable[[Any], None]) -> None:
    """:func:`register_compile_start`'s twin for Dynamo's end-of-compile callbacks."""
    handler = torch._dynamo.callback_handler
    if callback not in handler.end_callbacks:
        handler.register_end_callback(callback)


def starts_frame_compile(args: Any) -> bool:
    """Whether a compile callback's ``args`` are for Dynamo compiling a frame (trigger DYNAMO), not for
    aot_autograd's lazy backward compile or another trigger."""
    from torch._dynamo.callback import CallbackTrigger

    return args.callback_trigger is CallbackTrigger.DYNAMO


def ignore_in_ddp(module: torch.nn.Module, names: list[str]) -> None:
    """DistributedDataParallel's hook for parameters it must leave alone (they also get ``_ddp_ignored``,
    which keeps Dynamo's DDPOptimizer from splitting their graphs)."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose Python code is generated when first read or run, not on every ``recompile()``:
    planning copies and rewrites graphs that it never runs (Dynamo's own graphs are lazy the same way)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    return _LazyGraphModule(root, graph)


def graph_break_exceptions() -> tuple[type[Exception], ...]:
    """The exceptions a backend may raise that Dynamo turns into a graph break, running the frame eagerly with
    only a warning (``torch._dynamo.exc.exceptions_allowed_to_be_fallback``: FakeTensor's data-dependent,
    dynamic-shape and unsupported-operator errors)."""
    from torch._dynamo.exc import exceptions_allowed_to_be_fallback
    return tuple(exceptions_allowed_to_be_fallback)


def keep_dynamism_local() -> None:
    """No frame's dynamism comes from what an earlier process recorded on this host (Dynamo's local PGO),
    which ranks could read differently and then trace different graphs at the same step."""
    torch._dynamo.config.automatic_dynamic_local_pgo = False


def automatic_dynamic_shapes() -> bool:
    return bool(torch._dynamo.config.automatic_dynamic_shapes)


def keep_shapes_static() -> None:
    """A size goes symbolic only where the user asks (``dynamic=True``, ``mark_dynamic``): a frame compiled
    at one size compiles again at another rather than going symbolic on its own (automatic dynamic shapes)."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    keep_dynamism_local()


def dtensor_redistributions(op, args: tuple, kwargs: dict):
    """What DTensor's dispatcher will do for ``op(*args, **kwargs)``: one (current_spec, needed_spec)
    per DTensor positional argument, in order; [] when nothing is redistributed.

    Raises NotImplementedError when DTensor has no sharding strategy for the op.
    """
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    # the cached entry point: planning runs under FakeTensorMode, where DTensor itself would bypass
    # its cache ("tracing"); static shapes make every schema hashable, a symbolic one is not
    propagator = dispatcher.sharding_propagator
    sharding = (propagator.propagate_op_sharding_non_cached if _holds_symbols(info.schema)
                else propagator.propagate_op_sharding)(info.schema)
    if not sharding.needs_redistribute or sharding.redistribute_schema is None:
        return []
    return list(zip(info.schema.args_spec, sharding.redistribute_schema.args_spec))


def forget_sharding_answers() -> None:
    """Empty DTensor's cache of sharding answers. Its key compares meshes by their ranks and names, not their
    process groups, so after a job ends (its meshes dropped, new ones made for the same ranks) a cached answer
    would hand back specs on the old mesh, whose groups are gone ("Group ... is not registered" at a
    vocabulary-parallel loss's masked partial)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()


def _holds_symbols(schema) -> bool:
    specs = schema.args_spec
    return any(isinstance(size, torch.SymInt) for spec in specs for size in spec.shape) or any(
        isinstance(leaf, torch.SymInt) for leaf in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema)))


def dtensor_spec(value: Any):
    """A DTensor's spec (mesh, placements, global shape and stride); None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    return value._spec if isinstance(value, DTensor) else None


def local_layout(value: torch.Tensor) -> tuple:
    """A DTensor's local tensor's shape, stride, storage offset and ``requires_grad`` (its ``_local_tensor``,
    read without the view ``to_local`` makes)."""
    local = value._local_tensor
    return tuple(local.shape), local.stride(), local.storage_offset(), local.requires_grad


def local_storage(value: torch.Tensor):
    """The storage holding a tensor's bytes on this rank (a DTensor's: its local shard's)."""
    from torch.distributed.tensor import DTensor

    return (value._local_tensor if isinstance(value, DTensor) else value).untyped_storage()


def dtensor_local(value: torch.Tensor) -> torch.Tensor:
    """``to_local()``, or the local tensor itself where no gradient is recorded: ``to_local`` returns a
    view that autograd detaches in place outside grad mode, which ``invoke_subgraph``'s mutation check
    reads as a write to the block's input."""
    if torch.is_grad_enabled() and value.requires_grad:
        return value.to_local()
    return value._local_tensor


def dtensor_from_local(local: torch.Tensor, mesh, placements, shape: torch.Size, stride: tuple) -> torch.Tensor:
    """``DTensor.from_local`` without a check or communication, for any caller (see dtensor_from_spec)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return dtensor_from_spec(local, DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype)))


def dtensor_from_spec(local: torch.Tensor, spec) -> torch.Tensor:
    """``DTensor.from_local`` with a known spec (no check, no communication); outside grad mode the
    DTensor is built around a detached alias of ``local``, for the reason given in :func:`dtensor_local`."""
    from torch.distributed.tensor import DTensor

    if torch.is_grad_enabled() and local.requires_grad:
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)
    return DTensor(local.detach(), spec, requires_grad=False)


def has_sharding_strategy(op, direct_only: bool = False) -> bool:
    """Whether DTensor can shard ``op``: a strategy of its own, a custom handler or (unless
    ``direct_only``) DTensor's decomposition-based strategy."""
    from torch.distributed.tensor import DTensor

    if not isinstance(op, OpOverload):
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


def autocast_state() -> dict[str, torch.dtype]:
    """The autocast dtype of each device type where autocast is on (``torch._C``'s device list)."""
    return {device: torch.get_autocast_dtype(device) for device in torch._C._autocast_supported_devices()
            if torch.is_autocast_enabled(device)}


def default_store():
    """The store the default process group was set up with (``distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group that never communicates, for pass-level tests in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def register_sharding(op, strategies: Callable) -> None:
    """DTensor's sharding strategies for ``op``: ``strategies(*args, **kwargs)`` gives ``[(output placements,
    input placements), ...]`` (``torch.distributed.tensor.experimental.register_sharding``, experimental)."""
    from torch.distributed.tensor.experimental import register_sharding as register

    register(op)(strategies)


def core_aten_decompositions() -> dict:
    """ATen's core decompositions, op -> Python function (``torch._decomp.core_aten_decompositions``)."""
    from torch._decomp import core_aten_decompositions as decompositions

    return decompositions()


def decomposition(op) -> Callable | None:
    """ATen's decomposition of ``op`` (``torch._decomp.decomposition_table``); None where it has none."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


# -- vocab-parallel cross-entropy: the local computations of DTensor's loss_parallel ----------------------
def loss_parallel_forward(logits: torch.Tensor, target: torch.Tensor, weight, reduction: int, ignore_index: int,
                          global_shape: torch.Size, mesh, half_to_float: bool = False):
    """log_softmax + nll_loss over logits split along the class dimension (dim 1, or 0 for 1-D) on
    ``mesh``'s only dimension: (loss, total_weight, log-probabilities), with two all-reduces of one
    value per row in log_softmax and one in the target lookup, never the logits."""
    from torch.distributed.tensor.parallel import loss

    channel_dim = 1 if logits.dim() >= 2 else 0
    logp = loss._log_softmax(logits, channel_dim, half_to_float, mesh, 0)
    local_weight = None
    if weight is not None:
        local_weight = weight.chunk(mesh.size(), 0)[mesh.get_local_rank()]
    out, total_weight = loss._nll_loss_forward(logp, target, weight, local_weight, reduction, ignore_index,
                                               global_shape, channel_dim, mesh, 0)
    return out, total_weight, logp


def loss_parallel_backward(grad_output, logp, target, weight, reduction: int, ignore_index: int, total_weight,
                           global_shape: torch.Size, mesh):
    """The gradient of :func:`loss_parallel_forward`'s loss for the local logits (no communication)."""
    from torch.distributed.tensor.parallel import loss

    channel_dim = 1 if logp.dim() >= 2 else 0
    return loss._nll_loss_and_log_softmax_backward(grad_output, logp, target, weight, reduction, ignore_index,
                                                   total_weight, global_shape, channel_dim, mesh, 0)


# -- torch.distributed.checkpoint's private protocols (dynshard.checkpoint relies on them) ---------------
# DCP writes and reads an object by chunks at global offsets when the object has the methods of its
# private, duck-typed ``_Checkpointable`` protocol (DTensor implements it; ``planner_helpers.
# _create_write_items`` / ``_create_chunk_list`` look them up with ``hasattr``):
#   __create_write_items__(fqn, obj) -> list[WriteItem]: the chunks this rank writes;
#   __create_chunk_list__() -> list[ChunkStorageMetadata]: the chunks this rank reads into;
#   __get_tensor_shard__(index) -> Tensor: the local tensor of the chunk at ``index.offset``.
# ``dynshard.checkpoint.state.Pieces`` implements them. ``__get_tensor_shard__`` is only reached for
# ``torch.Tensor`` instances, so ``dynshard.checkpoint.planner`` looks pieces up itself. Also relied on
# (behaviour, not names): ``DefaultLoadPlanner.set_up_planner`` runs the private
# ``planner_helpers._init_state_dict``, which replaces objects it does not know with None; the load planner
# hides pieces behind strings around it. If a torch release teaches DCP the protocol there, drop the hiding.


# -- torch.distributed.pipelining's schedule generators (an oracle for dynshard.runtime.pipeline) ----------
def torch_pipeline_compute_order(schedule: str, pp_degree: int, nmicros: int,
                                 stages_per_rank: int | None = None) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, the compute actions ``(kind, stage, micro-batch)`` of torch's schedule class
    ``schedule`` (a name ``get_schedule_class`` knows, e.g. "Interleaved1F1B"), idle slots dropped; kind is
    "F", "B", "I" or "W". Wraps the private ``torch.distributed.pipelining._schedule_visualizer.
    get_schedule_ops``, which builds the schedule on mock stages in this process (no process group).
    Used by tests to compare dynshard's own generators with torch's; torch 2.13's "1F1B" order is wrong
    for the last rank (it skips F0 and adds F<m>), so never take that one as a reference."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(schedule, pp_degree, nmicros, num_stages_per_rank=stages_per_rank)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index) for a in rank if a is not None]
            for rank in ops]


def abstract_device_mesh(device_type: str, size: int, dim_name: str):
    """A 1-D DeviceMesh of ``size`` ranks named ``dim_name``, with no process group behind it and this
    process at coordinate 0, whatever the default process group is (none, fake, or real of any size): for
    DTensor sharding propagation on fake or meta tensors only; any collective on it fails. A name no real
    mesh has keeps DTensor's sharding cache (keyed by mesh equality) from handing its specs to one.
    ``DeviceMesh``'s private ``_init_backend=False, _rank=0``, as DTensor's decomposition strategies build
    their own fake mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.arange(size), mesh_dim_names=(dim_name,), _init_backend=False, _rank=0)


def planning_device_mesh(device_type: str, size: int, dim_name: str):
    """:func:`abstract_device_mesh` whose dimension has a process group DTensor's redistributions on
    FakeTensors can name: a fake one (it never communicates), registered as ``<dim_name>_<size>`` alone,
    beside whatever default process group exists (none, fake or real). Sharding propagation plans on it
    in any process, e.g. rank 0 of a real job planning for other layouts. Private c10d API
    (``ProcessGroup`` with a registered ``FakeProcessGroup`` backend, ``_register_process_group``), the
    way ``init_process_group("fake")`` builds its group."""
    from torch._C._distributed_c10d import (FakeProcessGroup, ProcessGroup, _register_process_group,
                                             _resolve_process_group)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    name = f"{dim_name}_{size}"
    if name not in _PLANNING_GROUPS:
        group = ProcessGroup(FakeStore(), 0, size)
        group._register_backend(torch.device(device_type), ProcessGroup.BackendType.CUSTOM,
                                FakeProcessGroup._create_internal(0, size, FakeProcessGroup.Options()))
        group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        group._set_group_name(name)
        _PLANNING_GROUPS[name] = group
    try:
        _resolve_process_group(name)
    except RuntimeError:            # (destroy_process_group unregisters every group, this one too)
        _register_process_group(name, _PLANNING_GROUPS[name])
    mesh = abstract_device_mesh(device_type, size, dim_name)
    mesh._dim_group_names = [name]
    return mesh


_PLANNING_GROUPS: dict = {}
