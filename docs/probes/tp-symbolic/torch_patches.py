"""Monkeypatches of torch 2.13 (probe only) for DTensor + symbolic sizes under aot_autograd."""
import operator
import sympy
import torch.fx.experimental.proxy_tensor as pt


def patch_pow():
    """_build_proxy_for_sym_expr cannot rebuild sympy.Pow (s**2, a DTensor stride from sharding propagation's
    untraced fake run): _sympy_handlers maps Pow to 'pow_by_natural', which is no operator attribute."""
    handlers = pt._sympy_handlers()          # (functools.cache: the dict is shared, add to it)
    handlers.setdefault(sympy.Pow, operator.pow)


def patch_self_cycle():
    """A sym op whose result simplifies to a bare input symbol (torch.sym_max(s, 1) -> s, in a stride computed for
    a DTensor in the backward) gets a proxy thunk that reads its argument, another SymInt of expression s that
    the tracer never saw; set_proxy_slot also overwrites sympy_expr_tracker[s] with that thunk, and the argument
    is then resolved through sympy_expr_tracker[s] -- the thunk itself: forced, it recurses forever
    (RecursionError in _compute_proxy). Skip registering a result that is a symbol the tracer already knows:
    get_proxy_slot then finds it through sympy_expr_tracker (the input's proxy)."""
    original = pt._sym_register

    def _sym_register(tracer, func, args, out):
        import torch
        if isinstance(out, torch.SymInt) and isinstance(out.node.expr, sympy.Symbol) \
                and out.node.expr in getattr(tracer, "sympy_expr_tracker", {}):
            return
        return original(tracer, func, args, out)
    pt._sym_register = _sym_register


def patch_all():
    patch_pow()
    patch_self_cycle()
