"""Names for a graph's values that survive a re-trace: ``<module path>:<op>:<occurrence>``.

FX node names (``mm_3``) depend on everything traced before a node; a plan keyed by them breaks when the
graph is traced again with one more op, or cut into pipeline stages. A node key names the innermost
module that ran the op (``layers.0.attn``, "" at the top level), the op (``aten.mm.default``) and which
of that module's calls of that op it is (0, 1, ...): ``layers.0.attn:aten.mm.default:1``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import torch.fx as fx

_ROOT = re.compile(r"^L\['[^']+'\]\.?")
_INDEX = re.compile(r"\[(\d+)\]")


@functools.lru_cache(maxsize=65536)
def _dotted(source: str) -> str:
    """Dynamo's module source (``L['self'].blocks[0].attn``) as a module path (``blocks.0.attn``): cached,
    since every op of a module asks again, in every copy of the graph a search makes."""
    return _INDEX.sub(r".\1", _ROOT.sub("", source)).strip(".")


def module_path(node: fx.Node) -> str:
    """The innermost module whose code produced ``node`` ("" for the model's own forward)."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    if not stack:
        return ""
    return _dotted(stack[-1][0])


def module_paths(node: fx.Node) -> list[str]:
    """Every module around ``node``, outermost first."""
    return [_dotted(path) for path, _ in node.meta.get("nn_module_stack", {}).values()]


def op_name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"method.{target}"
    if node.op in ("call_module", "get_attr"):
        return node.op
    if hasattr(target, "_schema"):            # an ATen op overload
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def node_keys(graph: fx.Graph) -> dict[fx.Node, str]:
    """Every op's key, in graph order (placeholders and the output have none)."""
    counts: Counter = Counter()
    keys: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        where = (module_path(node), op_name(node))
        keys[node] = f"{where[0]}:{where[1]}:{counts[where]}"
        counts[where] += 1
    return keys


def find_position(nodes: list[fx.Node], key: str, keys: dict[fx.Node, str]) -> int | None:
    """The position in ``nodes`` of the node ``key`` names: a node key, or a bare module path (its first op)."""
    if key.count(":") >= 2:
        return next((i for i, n in enumerate(nodes) if keys.get(n) == key), None)
    return next((i for i, n in enumerate(nodes) if key in module_paths(n)), None)
