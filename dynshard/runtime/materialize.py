"""Models built on the meta device: each rank allocates only its shards, initialised as on one process.

    with torch.device("meta"):
        model = GPT(cfg)                      # no memory
    model = torch.compile(model, backend="dynshard",
                          options=dynshard.Config(policy="tp", plan_ngpus=2, param_init_fn=init_module))

On the first run of a compiled program, every module of the model that owns meta parameters or buffers
directly is initialised, in ``model.modules()`` order, by ``Config.param_init_fn(module)`` or, without
one, by ``module.reset_parameters()``; the compiled program's tensors are then cut to this rank's piece.

Why it is done this way:

- **The values are those of one process.** Initialisers draw from the RNG, so the values depend on the
  order of the draws. Running the initialiser on every module that owns tensors, in ``model.modules()``
  order, over *all* of them (those no compiled graph uses, and buffers, too) on the whole tensor, draws
  exactly what ``torch.manual_seed(s); for m in model.modules(): init(m)`` draws on a full model on the
  same device, so the shards are slices of those values, whatever the plan. Every rank draws the same
  sequence when every rank seeds the same, so nothing is broadcast (a non-meta model's tensors are
  broadcast from rank 0 on their first run instead); a fingerprint per tensor (the sum of its bit
  patterns), compared in two small all-reduces (min, max), checks it and names the tensors that differ.
  The initialisation happens at the first step, with the RNG as it is then: seed before it, the same way
  on every rank, and draw nothing from the global RNG in between that the one-process run would not.
- **Peak memory is the local shards plus one module's tensors.** One module at a time: its own tensors
  are allocated whole on the device (``to_empty`` on that module alone), initialised, and those the
  program uses are cut to this rank's piece (:func:`.sharding.stored_piece`: the tp shard, of which the
  ZeRO rows) and the whole tensor freed. A tensor that a later module shares (a tied embedding) stays
  whole until its last owner is initialised, as the later initialiser may read or overwrite it.
  Parameters that no compiled program has used yet, and buffers, stay whole (untagged) until a program
  that uses them shards them in place, as for a model built on a real device.
- **The same parameter objects.** Optimisers built before the first step hold the meta parameters. A
  meta tensor cannot take another device's data through ``.data``, so each one's contents are swapped
  (``torch.utils.swap_tensors``) for a stand-in on the real device, once, before Dynamo first sees it;
  from then on ``.data`` is replaced, as for any sharded parameter.
- **Dynamo traces stand-ins.** Dynamo cannot trace meta parameters with inputs on a real device (its
  fake tensors refuse the mix of devices). So when Dynamo starts tracing a frame for dynshard whose
  modules hold meta tensors, each meta tensor becomes a stand-in on the inputs' device with its own
  shape and contiguous strides, what it will be once materialised, so Dynamo's guards still hold after
  the first step. The parameters' stand-ins share one scratch storage of the largest one's size (nothing
  reads it; it is freed when materialisation starts); a buffer gets memory of its own (a buffer updated
  in the forward must not alias another input), which it needs anyway: buffers stay whole.

The module is found from the frame Dynamo compiles (the modules among its arguments, closure and the
globals its code names), so it is the module compiled (``torch.compile(model)``), or the outermost one a
compiled function reaches. The trace hook is registered when dynshard is imported and again by every
dynshard compile; ``torch._dynamo.reset()`` drops it until then: call :func:`install` after a reset before
compiling a meta model. An initialiser may assign new tensors (``m.weight = nn.Parameter(...)``): their
values move into the original objects. Load a checkpoint after the first step (``relocate_state_dict``):
before it the tensors have no values (``load_state_dict`` into meta tensors does nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import compat
from .backend_identity import compiling_for_dynshard
from .call_stack import caller_self
from .compile_hooks import around_dynamo_compiles
from .sharding import mark_initialized_alike, shard_in_place

PENDING_ATTR = "_dynshard_pending_init"   # on a stand-in: the _Pending model it is materialised with
_STAND_IN_FILL = 0xFF                      # stand-ins read as NaN (floats) or -1 (integers), never as values


class MetaInitError(RuntimeError):
    """A model built on the meta device cannot be materialised; the message says what to change."""


@dataclasses.dataclass(eq=False)
class _Pending:
    """A model (the root module) whose meta tensors are stand-ins, waiting for its first step."""

    module: weakref.ref
    device: torch.device
    init_fn: Callable[[nn.Module], None] | None
    init_name: str
    done: bool = False


def install() -> None:
    """Register the hook that presents meta tensors as stand-ins while Dynamo traces for dynshard (again
    after ``torch._dynamo.reset()``); idempotent."""
    around_dynamo_compiles(_present_meta_models, _after_compile)


def frame_models() -> list[_Pending]:
    """The pending models of the frame being compiled (a program built now materialises them first): read
    off the frame and its models' stand-ins, so that nothing outlives the compile."""
    frame = _frame_being_compiled() if compiling_for_dynshard() else None
    if frame is None:
        return []
    found = (_pending_of(root) for root in _outermost(_modules_of(frame)))
    return [pending for pending in found if pending is not None and not pending.done]


def default_device(device_type: str) -> torch.device:
    """Where tensors of ``device_type`` are made when nothing says which device: the current one."""
    if device_type in ("cpu", "meta"):
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(device_type, module.current_device())
    return torch.device(device_type)


# -- before Dynamo traces: stand-ins ------------------------------------------------------------------

def _present_meta_models() -> None:
    """Dynamo's start hook: meta tensors of the frame's models become stand-ins on the real device."""
    if not compiling_for_dynshard():
        return
    frame = _frame_being_compiled()
    if frame is None:
        return
    candidates = _modules_of(frame)
    device = None
    for root in _outermost(candidates):
        meta = [t for t in _tensors(root) if t.is_meta]
        pending = _pending_of(root)
        if pending is None and meta:
            device = device or _input_device(frame)
            init_fn = _configured_init_fn(frame.get("compiler_fn"))
            pending = _Pending(weakref.ref(root), device, init_fn,
                               getattr(init_fn, "__qualname__", repr(init_fn)) if init_fn else "reset_parameters")
            _check_initialisers(root, pending, meta)
            _swap_for_stand_ins(root, meta, pending)


def _after_compile() -> None:
    """Dynamo's end hook: nothing to undo (the stand-ins stay until the first step)."""


def _frame_being_compiled() -> dict[str, Any] | None:
    return compat.compiling_frame()


def _configured_init_fn(compiler_fn: Any) -> Callable[[nn.Module], None] | None:
    """``Config.param_init_fn`` of the options torch.compile was given."""
    from ..config import Config

    if compiler_fn is None:
        return None
    return Config.from_options(compat.backend_options(compiler_fn)).param_init_fn  # its ConfigError, only earlier


def frame_roots() -> list[nn.Module]:
    """The outermost user modules (behind ``torch.compile``'s wrapper) of the frame Dynamo is compiling."""
    frame = compat.compiling_frame()
    if frame is None:
        return []
    return _outermost([getattr(m, "_orig_mod", m) for m in _modules_of(frame)])


def roots_holding(tensor: torch.Tensor) -> list[nn.Module]:
    """The module running on the call stack that holds ``tensor`` (behind ``torch.compile``'s wrapper): the
    frame's module when Dynamo serves a frame compiled for one model to another model of its class, whose
    modules :func:`frame_roots` never saw."""
    def holds(candidate: Any) -> bool:
        return isinstance(candidate, nn.Module) and any(
            t is tensor for t in itertools.chain(candidate.parameters(), candidate.buffers()))

    module, _ = caller_self(holds)
    return [] if module is None else [getattr(module, "_orig_mod", module)]


def _modules_of(frame: dict[str, Any]) -> list[nn.Module]:
    """The modules the compiled code can reach directly: its arguments and locals, its closure, and
    the globals it names."""
    found: list[Any] = []
    for value in (frame.get("locals") or {}).values():     # (a decorator's wrapper holds self in its args)
        found += list(value.values()) if isinstance(value, dict) else \
            list(value) if isinstance(value, (tuple, list)) else [value]
    for cell in frame.get("closure") or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:       # an empty cell
            pass
    code, global_vars = frame.get("code"), frame.get("globals") or {}
    found += [global_vars[name] for name in getattr(code, "co_names", ()) if name in global_vars]
    return [m for m in found if isinstance(m, nn.Module)]


def _outermost(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules that are no other one's submodule, each once, in the order found."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    seen: set[int] = set()
    roots = []
    for m in modules:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            roots.append(m)
    return roots


def _input_device(frame: dict[str, Any]) -> torch.device:
    """The device of the frame's tensor arguments; else the current accelerator; else the CPU."""
    for value in (frame.get("locals") or {}).values():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for item in values:
            if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter) and not item.is_meta:
                return item.device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return default_device(accelerator.type) if accelerator is not None else torch.device("cpu")


def _tensors(root: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``root``, each once."""
    seen: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for tensor in _owned(module):
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _owned(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` owns directly (recurse=False), each once."""
    owned: dict[int, torch.Tensor] = {}
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        owned.setdefault(id(tensor), tensor)
    return list(owned.values())


def _pending_of(root: nn.Module) -> _Pending | None:
    for tensor in _tensors(root):
        pending = getattr(tensor, PENDING_ATTR, None)
        if pending is not None and pending.module() is root:
            return pending
    return None


def _names(root: nn.Module) -> tuple[dict[int, str], dict[int, str]]:
    """Fully qualified names of ``root``'s tensors and modules, by id (for messages and the check)."""
    tensors = {id(t): n for n, t in (*root.named_parameters(remove_duplicate=False),
                                     *root.named_buffers(remove_duplicate=False))}
    modules = {id(m): n or type(root).__name__ for n, m in root.named_modules()}
    return tensors, modules


def _check_initialisers(root: nn.Module, pending: _Pending, meta: Iterable[torch.Tensor]) -> None:
    """Without param_init_fn, every module owning meta tensors needs ``reset_parameters()``."""
    if pending.init_fn is not None:
        return
    meta_ids = {id(t) for t in meta}
    _, module_names = _names(root)
    missing = [f"'{module_names[id(m)]}' ({type(m).__name__})" for m in root.modules()
               if any(id(t) in meta_ids for t in _owned(m)) and not callable(getattr(m, "reset_parameters", None))]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MetaInitError(
            f"dynshard: the model was built on the meta device, and {shown} own meta parameters or buffers "
            "but have no reset_parameters(); pass Config(param_init_fn=init) with init(module) initializing "
            "the tensors a module owns directly, or give these modules a reset_parameters()")


def _swap_for_stand_ins(root: nn.Module, meta: Sequence[torch.Tensor], pending: _Pending) -> None:
    """Each meta tensor takes a stand-in's contents (same Python object): parameters share one scratch
    storage of the largest one's size, buffers get their own."""
    def storage(nbytes: int) -> torch.UntypedStorage:
        return torch.full((nbytes,), _STAND_IN_FILL, dtype=torch.uint8, device=pending.device).untyped_storage()

    params = [t for t in meta if isinstance(t, nn.Parameter)]
    scratch = storage(max((_nbytes(t) for t in params), default=0))
    tensor_names, _ = _names(root)
    for tensor in meta:
        stand_in = torch.empty(0, dtype=tensor.dtype, device=pending.device).set_(
            scratch if isinstance(tensor, nn.Parameter) else storage(_nbytes(tensor)), 0, tensor.shape,
            _contiguous_stride(tensor.shape))
        _swap(tensor, stand_in, tensor_names.get(id(tensor), "a tensor"))
        setattr(tensor, PENDING_ATTR, pending)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _swap(tensor: torch.Tensor, data: torch.Tensor, name: str) -> None:
    """``tensor`` (the same Python object) takes ``data``'s contents; its class and attributes stay."""
    if isinstance(tensor, nn.Parameter):
        data = nn.Parameter(data, requires_grad=tensor.requires_grad)
    else:
        data.requires_grad_(tensor.requires_grad)
    if type(data) is not type(tensor):
        data.__class__ = type(tensor)
    data.__dict__.update(tensor.__dict__)
    try:
        torch.utils.swap_tensors(tensor, data)
    except RuntimeError as error:
        raise MetaInitError(
            f"dynshard: cannot give {name} real memory in place ({error}); the meta model's tensors must not "
            "be referenced by weak references, views or an autograd graph before its first step") from None


# -- the first step: materialise ----------------------------------------------------------------------

def materialize(models: Iterable[_Pending], plan: Any, args: Sequence[Any],
                cut: Callable[[torch.Tensor, Any], None] | None = None) -> None:
    """Initialise the pending models ``plan``'s first run touches (those of the frame it was compiled
    from, and those its arguments belong to), cutting ``plan``'s own tensors to this rank's piece as each
    is initialised: ``cut(tensor, graph_input)``, by default the plan's placements and ZeRO rows (a
    pipeline keeps what its stages read and frees the rest)."""
    models = [m for m in models if not m.done]
    state = [inp for inp in plan.inputs if inp.is_state]
    for inp in state:
        tensor = args[inp.index]
        if tensor.is_meta:
            raise MetaInitError(
                f"dynshard: {inp.name} is on the meta device, but dynshard did not see its module before "
                "Dynamo traced it; compile the module (torch.compile(model, ...)) or pass it to the compiled "
                "function, and after torch._dynamo.reset() call dynshard.runtime.materialize.install()")
        pending = getattr(tensor, PENDING_ATTR, None)
        if pending is not None and not pending.done and pending not in models:
            models.append(pending)
    if not models:
        return
    mine = {id(args[inp.index]): inp for inp in state}
    if cut is None:
        def cut(tensor: torch.Tensor, inp: Any) -> None:
            shard_in_place(tensor, inp.name, plan.layout, plan.placements[inp.index],
                           plan.zero.get(inp.index)).add_plan(plan)
    for pending in models:
        _materialize(pending, mine, cut)


def _materialize(pending: _Pending, mine: dict[int, Any], cut: Callable[[torch.Tensor, Any], None]) -> None:
    root = pending.module()
    pending.done = True
    if root is None:
        return
    tensors = [t for t in _tensors(root) if getattr(t, PENDING_ATTR, None) is pending]
    waiting = {id(t) for t in tensors}
    modules = [m for m in root.modules() if any(id(t) in waiting for t in _owned(m))]
    last_owner = {id(t): i for i, m in enumerate(modules) for t in _owned(m) if id(t) in waiting}
    tensor_names, module_names = _names(root)
    init = pending.init_fn or _reset_parameters
    with torch.no_grad():
        for tensor in tensors:       # the stand-ins let their scratch memory go
            tensor.data = torch.empty((), dtype=tensor.dtype, device=pending.device).expand(tensor.shape)
    allocated: set[int] = set()
    fingerprints, fingerprinted = [], []
    for index, module in enumerate(modules):
        owned = [t for t in _owned(module) if id(t) in waiting]
        with torch.no_grad():        # to_empty on this module alone
            for tensor in owned:
                if id(tensor) not in allocated:
                    allocated.add(id(tensor))
                    tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype, device=pending.device)
        before = _slots(module, waiting)
        with torch.no_grad():
            init(module)
        _keep_objects(module, before, pending, tensor_names, module_names.get(id(module), ""))
        for tensor in owned:
            if last_owner[id(tensor)] != index:
                continue      # a later module shares it: it stays whole until that one is initialised
            fingerprints.append(_fingerprint(tensor))
            fingerprinted.append(tensor_names.get(id(tensor), "?"))
            delattr(tensor, PENDING_ATTR)
            mark_initialized_alike(tensor)
            inp = mine.get(id(tensor))
            if inp is not None:     # this program's tensor: cut to this rank's piece now, the whole one freed
                cut(tensor, inp)
    _check_ranks_agree(fingerprints, fingerprinted, pending.device)


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise MetaInitError(f"dynshard: {type(module).__name__} owns meta tensors but has no reset_parameters(); "
                            "pass Config(param_init_fn=...)")
    reset()


def _slots(module: nn.Module, waiting: set[int]) -> dict[tuple[str, str], torch.Tensor]:
    """The module's own waiting tensors by (table, name)."""
    return {(table, name): tensor for table in ("_parameters", "_buffers")
            for name, tensor in getattr(module, table).items() if tensor is not None and id(tensor) in waiting}


def _keep_objects(module: nn.Module, before: dict[tuple[str, str], torch.Tensor], pending: _Pending,
                  tensor_names: dict[int, str], module_name: str) -> None:
    """The module keeps the tensor objects it had: an initialiser that assigned a new tensor (``m.weight =
    nn.Parameter(...)``, ``m.register_buffer(...)``) has its values moved into the original object, which
    optimisers, Dynamo and dynshard hold. Shapes and dtypes must not change."""
    for (table, name), old in before.items():
        new = getattr(module, table).get(name)
        label = tensor_names.get(id(old), f"{module_name}.{name}".lstrip("."))
        if new is None:
            raise MetaInitError(f"dynshard: {pending.init_name} removed {label}; initialise it in place instead")
        if new.shape != old.shape or new.dtype != old.dtype:
            raise MetaInitError(
                f"dynshard: {pending.init_name} changed {label} from {tuple(old.shape)} {old.dtype} to "
                f"{tuple(new.shape)} {new.dtype}; a meta model's tensors keep the shapes and dtypes they were "
                "built with")
        if new is old and old.device == pending.device:
            continue
        with torch.no_grad():
            old.data = new.detach().to(pending.device)
        getattr(module, table)[name] = old


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bit patterns, as int64 (identical values give identical sums on any rank)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size(), torch.uint8)
    return tensor.detach().reshape(-1).view(ints).sum(dtype=torch.int64)


def _check_ranks_agree(fingerprints: list[torch.Tensor], names: list[str], device: torch.device) -> None:
    """Every rank initialised the same values (one all-reduce of the minimum and one of the maximum)."""
    if not fingerprints or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    local = torch.stack(fingerprints).to(device)
    low, high = local.clone(), local.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = [names[i] for i in torch.nonzero(low != high).flatten().tolist()]
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise MetaInitError(
            f"dynshard: ranks initialised different values for {shown}: a meta model is initialised on every "
            "rank from its own RNG, so seed every rank the same (torch.manual_seed(s) on all ranks) before the "
            "first step, and make the initialiser fill every element deterministically")


install()
