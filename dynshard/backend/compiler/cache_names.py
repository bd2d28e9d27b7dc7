"""Names for aot_autograd's cache: a dynshard program's calls named so that its key tells programs apart.

With them a restart, and every rank of a host but one, reads the traced and partitioned program instead of
tracing it through DTensor again (:mod:`.cached_compile`).

aot_autograd keys its cache on the graph Dynamo hands it: the graph's code, the names its calls import,
its inputs' metadata and the compile settings. A dynshard program calls dynshard's own functions (a
parameter's gather and gradient reduction, DTensor entry and exit, placements), which aot_autograd refuses
("Unsupported call_function target"), and two of them with the same code may capture different state: the
rank's tp coordinate (which chunk a Replicate->Shard redistribute keeps), ZeRO-1's rank (which rows of the
reduced gradient it keeps), the no-sync variant's flag. The key cannot see a closure, so
:func:`program_functions_named` calls each such function through a copy named by a digest of its code, of
dynshard's source and of everything it captures, registered in this module where the key's pickle imports
it. Ranks with the same program (a data-parallel group's) then share a key, and ranks whose programs differ
only in captured state do not:

- a process group's name becomes its shape (:func:`~.shared_compiles.group_alias`), as in Inductor's graphs;
- a device mesh becomes its shape, its dimension names, its groups' shapes and this rank's coordinate;
- a dataclass, a placement, a number: their fields or repr; a function: its code and what it captures;
- anything else (a dict a function writes while it is traced, ``Config(gather_outputs=False)``'s output
  specs, which a cache hit would leave unwritten) cannot be digested, and the program is compiled as
  before, without the cache.

What a hit skips, and what dynshard records beside the entry, is :mod:`.cached_compile`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import types
from typing import Any

import torch
import torch.fx as fx

from ... import compat
from ...compat import aot_autograd
from .shared_compiles import group_alias, rank_free_compiles

log = logging.getLogger("dynshard")


class _Undigestable(Exception):
    pass


def program_functions_named(gm: fx.GraphModule) -> bool:
    """Every call of ``gm`` (and of the graphs it calls) to a function aot_autograd's cache does not know
    goes through a copy named by a digest of the function's code and captured state, and is marked as
    aot_autograd's cache wants a wrapped function to be (``is_wrapped``, ``user_cache_hash``). False,
    with ``gm`` left as it was, where some call's state cannot be digested."""
    renamed: list[tuple[fx.Node, Any, str]] = []
    copies: dict[str, tuple[types.FunctionType, str]] = {}    # name -> this program's copy
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or aot_autograd.cache_keys_call(node):
                continue
            target = node.target
            # (only dynshard's own: the source digest in the name covers what they call)
            if not isinstance(target, types.FunctionType) or not _is_dynshards(target):
                log.debug("dynshard: aot_autograd's cache skips a program calling %s", target)
                return False
            try:
                name, digest = _digest_name(target)
            except Exception as reason:      # (_Undigestable, or a mesh without groups, ...)
                log.debug("dynshard: aot_autograd's cache skips a program: %s captures %s", target.__name__, reason)
                return False
            if name not in copies:     # (functions of one digest behave alike: the first one's copy serves all)
                copies[name] = (_named_copy(target, name), digest)
            renamed.append((node, *copies[name]))
    for node, copy, digest in renamed:
        node.target = copy
        aot_autograd.mark_wrapped(node, digest)
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.recompile()
    return True


def _is_dynshards(function: types.FunctionType) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module == "dynshard" or module.startswith("dynshard.")


def state_digest(value: Any) -> str:
    """A digest of dynshard's source and of :func:`_state` of ``value`` (raises where it has none)."""
    digest = hashlib.sha256("\n".join((dynshard_source_digest(), _rank_part(), _state(value))).encode())
    return digest.hexdigest()[:20]


def _digest_name(function: types.FunctionType) -> tuple[str, str]:
    digest = state_digest(function)
    return f"{getattr(function, '_dynshard_base_name', function.__name__)}_{digest}", digest


def _named_copy(function: types.FunctionType, name: str) -> types.FunctionType:
    """A new copy for each program, registered under ``name`` (the last one registered is the one the
    key's pickle finds): a copy made for an earlier program holds that program's cells, such as an
    outlined block's boundary and the specs its trace recorded, which a later program must not read."""
    base = getattr(function, "_dynshard_base_name", function.__name__)
    # (named in the graph's code too, so that the lock of shared_compiles tells such programs apart)
    copy = types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__module__, copy.__qualname__, copy._dynshard_base_name = __name__, name, base
    globals()[name] = copy
    return copy


def _rank_part() -> str:
    """Where Inductor's settings make each rank compile its own code (``rank_free_compiles``), each rank
    keeps its own entries at this level too."""
    if rank_free_compiles() or not torch.distributed.is_initialized():
        return ""
    return f"rank {torch.distributed.get_rank()}"


@functools.lru_cache(maxsize=1)
def dynshard_source_digest() -> str:
    """A digest of dynshard's source: what a captured function calls may change with it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # dynshard/
    digest = hashlib.sha256()
    for directory, subdirectories, files in sorted(os.walk(root)):
        subdirectories.sort()
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, file)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()


def _state(value: Any, depth: int = 0) -> str:
    """A description of ``value`` that names everything a traced program could read from it, and no
    process's identity (group names by their shape, meshes by their shape and this rank's coordinate)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

    if depth > 12:
        raise _Undigestable("state nested too deep")
    if value is None or isinstance(value, (bool, int, float, complex, torch.dtype, torch.device, torch.Size,
                                           enum.Enum, type(Ellipsis))):
        return repr(value)
    if isinstance(value, str):
        return repr(_group_shape(value))
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_state(v, depth + 1) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"set({', '.join(sorted(_state(v, depth + 1) for v in value))})"
    if isinstance(value, Placement):
        return repr(value)
    if isinstance(value, DeviceMesh):
        groups = [_group_shape(value.get_group(dim).group_name) for dim in range(value.ndim)]
        return f"mesh{tuple(value.shape)} {value.mesh_dim_names} at {value.get_coordinate()} groups {groups}"
    if hasattr(type(value), "__dynshard_cache_state__"):
        return f"{type(value).__qualname__}({value.__dynshard_cache_state__()})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_state(getattr(value, f.name), depth + 1)}"
                           for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, types.FunctionType):
        code = _code_state(value.__code__)
        cells = [_state(cell.cell_contents, depth + 1) if _filled(cell) else "<empty>"
                 for cell in value.__closure__ or ()]
        return (f"function {value.__module__}.{getattr(value, '_dynshard_base_name', value.__qualname__)} "
                f"{code} defaults {_state(value.__defaults__, depth + 1)} "
                f"kwdefaults {_state(sorted((value.__kwdefaults__ or {}).items()), depth + 1)} "
                f"cells [{', '.join(cells)}]")
    if isinstance(value, functools.partial):
        return (f"partial({_state(value.func, depth + 1)}, {_state(value.args, depth + 1)}, "
                f"{_state(sorted(value.keywords.items()), depth + 1)})")
    if isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType, compat.OpOverload,
                          compat.OpOverloadPacket, compat.HigherOrderOperator)):
        return f"{type(value).__name__} {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    raise _Undigestable(f"a {type(value).__qualname__}")


def _code_state(code: types.CodeType) -> str:
    consts = [(_code_state(c) if isinstance(c, types.CodeType) else repr(c)) for c in code.co_consts]
    digest = hashlib.sha256(code.co_code + repr((code.co_names, consts, code.co_varnames)).encode())
    return digest.hexdigest()[:16]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _group_shape(name: str) -> str:
    """A process group's name as its shape (the alias Inductor's graphs use); any other string as it is."""
    if not torch.distributed.is_initialized():
        return name
    return group_alias(name)
