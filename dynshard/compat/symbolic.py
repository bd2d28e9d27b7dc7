"""Symbolic sizes in Dynamo's graphs (``dynamic=True``, ``mark_dynamic``): which dimensions of a graph input
are symbolic, and the sizes they were traced at. Re-exported by :mod:`dynshard.compat`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx

from .strided_shards import strided_shards_on_symbols


def symbolic_dims(node: fx.Node) -> list[str | None] | None:
    """Per dimension of the placeholder ``node``'s traced value, its symbolic expression (Dynamo's symbol
    names, e.g. ``s33``, ``2*s33``) or None where it is static; for a SymInt input, its expression alone.
    None when nothing about the input is symbolic."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.SymInt):
        return [str(value.node.expr)]
    if not isinstance(value, torch.Tensor):
        return None
    dims = [None if isinstance(size, int) or _is_constant(size) else str(size.node.expr) for size in value.shape]
    return dims if any(d is not None for d in dims) else None


def _is_constant(size: torch.SymInt) -> bool:
    return size.node.expr.is_number


def size_hint(value: Any) -> int:
    """The size a symbolic size was traced at (the int itself for a static one), read without adding a
    guard: a dynshard record (bytes saved, bytes sent) must not specialize the program."""
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    if isinstance(value, int):
        return value
    return int(guarding_hint_or_throw(value))


def sizes_key(sizes) -> tuple:
    """Sizes as a key: a symbolic one by its expression (SymInts do not hash)."""
    return tuple(size if isinstance(size, int) else str(size) for size in sizes)


def dynamo_fake_mode():
    """The fake mode of the frame Dynamo is compiling (its tracing context's, whose ShapeEnv takes the
    compile's guards)."""
    from torch._guards import TracingContext

    return TracingContext.get().fake_mode


def static_fake(fake_mode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake of ``tensor`` in ``fake_mode`` with static sizes (``FakeTensorMode.from_tensor``)."""
    return fake_mode.from_tensor(tensor, static_shapes=True)


def dynamo_tracing_context():
    """The tracing context of the frame Dynamo is compiling (None outside a compile)."""
    from torch._guards import TracingContext

    return TracingContext.try_get()


def traced_in(context):
    """Re-enter a frame's tracing context for a compile that happens later (a program variant compiled at
    its first use), as aot_autograd does for a backward compiled at its first call."""
    from torch._guards import tracing

    return tracing(context)


def specialize_floats(specialize: bool) -> bool:
    """Set whether Dynamo traces a Python float as a constant (``specialize_float``); the previous setting."""
    previous = torch._dynamo.config.specialize_float
    torch._dynamo.config.specialize_float = specialize
    return previous


@contextlib.contextmanager
def guards_left_out(fake_mode) -> Iterator[None]:
    """Within, ops on ``fake_mode``'s symbolic tensors add no guard to the frame and keep nothing in its fake
    tensor cache (an entry computed with its guards left out would later be served without them): a trial
    whose failure must leave the frame as it was."""
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache

    shape_env = fake_mode.shape_env
    with (shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()), \
            disable_fake_tensor_cache(fake_mode):
        yield


@contextlib.contextmanager
def dtensor_symbolic_tracing() -> Iterator[None]:
    """torch 2.13's proxy tracer (aot_autograd's) on programs with DTensors of symbolic sizes, with two of its
    bugs mended while inside (both met tracing a Megatron block at a symbolic sequence length, see
    docs/probes/tp-symbolic/):

    - a size expression ``s**2`` (a DTensor's stride from its sharding propagation's untraced fake run) has no
      proxy rebuild: ``_sympy_handlers`` maps ``sympy.Pow`` to ``pow_by_natural``, no operator attribute
      ("s21**2 ... is not tracked with proxy");
    - a sym op whose result simplifies to a bare input symbol (``torch.sym_max(s, 1)`` -> ``s``, a stride in the
      backward) registers a thunk that reads its argument, and overwrites the tracer's entry for ``s`` with
      it: the argument then resolves through that entry to the thunk itself (``RecursionError`` in
      ``_compute_proxy``). Such a result is not registered: the tracer finds ``s`` as it knew it.

    And DTensor's ``_StridedShard`` takes a split factor that is a symbol of Dynamo's (see :mod:`.strided_shards`).
    """
    import operator

    import sympy
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    handlers = proxy_tensor._sympy_handlers()       # (functools.cache: one dict, shared)
    added_pow = sympy.Pow not in handlers
    if added_pow:
        handlers[sympy.Pow] = operator.pow
    register = proxy_tensor._sym_register

    def _sym_register(tracer, func, args, out):
        if isinstance(out, torch.SymInt) and isinstance(out.node.expr, sympy.Symbol) \
                and out.node.expr in getattr(tracer, "sympy_expr_tracker", {}):
            return None
        return register(tracer, func, args, out)

    proxy_tensor._sym_register = _sym_register
    try:
        with strided_shards_on_symbols():
            yield
    finally:
        proxy_tensor._sym_register = register
        if added_pow:
            handlers.pop(sympy.Pow, None)
