"""Inductor's private pieces that dynshard's compile driver (:mod:`dynshard.backend.compiler`) calls: its
compile entry points (``torch._inductor.compile_fx``), settings, cache directory and counters (its pass and
partitioner base classes are re-exported by the package). Each wraps one thing and decides nothing."""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch.fx as fx


def compile_fx(gm: fx.GraphModule, example_inputs: list, inner_compile, config_patches: dict):
    """``torch._inductor.compile_fx.compile_fx``: aot_autograd, then ``inner_compile`` per graph."""
    from torch._inductor.compile_fx import compile_fx as compile

    return compile(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)


def compile_fx_inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs):
    """``torch._inductor.compile_fx.compile_fx_inner``: Inductor's compile of one partitioned graph."""
    from torch._inductor.compile_fx import compile_fx_inner as compile

    return compile(graph, inputs, **kwargs)


def settings(patches: dict):
    """``torch._inductor.config.patch(patches)``: Inductor's settings changed within."""
    from torch._inductor import config

    return config.patch(patches)


def setting(name: str, *default: Any) -> Any:
    """The Inductor setting ``name`` (dotted: ``"cpp.simdlen"``), or ``default`` where it is absent."""
    from torch._inductor import config

    value: Any = config
    for part in name.split("."):
        value = getattr(value, part, *default)
    return value


def register_bucketing_ops() -> None:
    """Import Inductor's bucketing pass, which registers the custom ops its merged buckets call (programs
    read from Inductor's cache call them too)."""
    importlib.import_module("torch._inductor.fx_passes.bucketing")


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, ``cache_dir_utils.cache_dir``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as directory

    return directory()


def counter(group: str, name: str) -> int:
    """One of Dynamo's compile counters (``torch._dynamo.utils.counters``), e.g. Inductor's cache bypasses."""
    from torch._dynamo.utils import counters

    return counters[group][name]


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (``torch._dynamo.config.compiled_autograd``)."""
    import torch._dynamo

    return bool(torch._dynamo.config.compiled_autograd)


def own_output_strides():
    """Within: a compile reports its outputs' strides into a list of its own
    (``TracingContext.report_output_strides``), not the one aot_autograd reads the program's from."""
    from torch._guards import TracingContext

    return TracingContext.report_output_strides()


def outputs_keep_traced_strides(graph: fx.GraphModule) -> None:
    """Inductor returns ``graph``'s tensor outputs with the strides they were traced with (the output node's
    ``user_visible_output_idxs``)."""
    for output in graph.graph.find_nodes(op="output"):
        output.meta["user_visible_output_idxs"] = [i for i, value in enumerate(output.args[0])
                                                   if isinstance(value, fx.Node)]
