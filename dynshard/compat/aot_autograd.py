"""aot_autograd's private pieces that dynshard's compile driver (:mod:`dynshard.backend.compiler`) calls: Dynamo's
aot_autograd backend and aot_eager's compiler, the partitioners, functorch's settings, and its cache's key
(``torch._functorch._aot_autograd.autograd_cache``). Each wraps one thing and decides nothing."""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from .counted_patch import CountedPatch


def aot_autograd_backend(**compilers):
    """Dynamo's aot_autograd backend (``torch._dynamo.backends.common.aot_autograd``) with these compilers."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**compilers)


def boxed_nop(graph: fx.GraphModule, inputs):
    """aot_eager's compiler (``torch._dynamo.backends.debugging.boxed_nop``): the graph runs as traced, boxed
    (each input freed after its last use)."""
    from torch._dynamo.backends.debugging import boxed_nop as nop

    return nop(graph, inputs)


def default_partition(*args, **kwargs):
    """aot_autograd's default partitioner (``torch._functorch.partitioners.default_partition``)."""
    from torch._functorch.partitioners import default_partition as partition

    return partition(*args, **kwargs)


def min_cut_partition(*args, **kwargs):
    """Inductor's partitioner (``torch._functorch.partitioners.min_cut_rematerialization_partition``)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(*args, **kwargs)


def settings(**patches: Any):
    """``torch._functorch.config.patch(**patches)``: aot_autograd's settings changed within."""
    from torch._functorch import config

    return config.patch(**patches)


def setting(name: str) -> Any:
    """The aot_autograd setting ``name`` (``torch._functorch.config``)."""
    from torch._functorch import config

    return getattr(config, name)


def cache_keys_call(node: fx.Node) -> bool:
    """Whether aot_autograd's cache can key the call ``node`` as it is (``autograd_cache.check_node_safe``)."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

    try:
        check_node_safe(node)
    except BypassAOTAutogradCache:
        return False
    return True


def mark_wrapped(node: fx.Node, digest: str) -> None:
    """Mark a call as aot_autograd's cache wants a wrapped function's to be (``is_wrapped``, keyed by
    ``user_cache_hash``)."""
    node.meta["is_wrapped"], node.meta["user_cache_hash"] = True, digest


def _autograd_cache_module():
    from torch._functorch._aot_autograd import autograd_cache
    return autograd_cache


def cache_key_patch(replace: Callable[[Callable], Callable]) -> CountedPatch:
    """``autograd_cache.autograd_cache_key`` (aot_autograd's cache key of a compile, returned with its debug
    lines: ``(key, debug_lines)``) replaced by ``replace(aot_autograd's)`` while the patch is applied."""
    return CountedPatch(_autograd_cache_module, "autograd_cache_key", replace)
