"""Outputs split inside the plan unit are gathered every step: say so, once per program.

transformers' models return their full logits and, with ``use_cache`` left at its default while
training, the KV cache. Under tp these are split (along the vocabulary, by heads), and with
``Config(gather_outputs=True)``, the default, every rank receives them whole: an all-gather per output
per step that the training loop never asked for (gigabytes per step for a 128k vocabulary). This pass
reads the placements ``propagate_sharding`` found for the program's outputs and warns, naming each such
output, its bytes per step and the fix. The loss (a partial sum, all-reduced: a few bytes) is not one.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import torch
import torch.fx as fx

from .. import compat
from ..runtime.sharding import SHARDS
from .context import PassContext
from .propagate_sharding import source_line

FIX = ("pass use_cache=False to a transformers model while training, return only what the step needs "
       "(the loss), or set Config(gather_outputs=False) to receive split outputs as DTensors, not gathered")


def warn_gathered_outputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    # (a pipeline stage's outputs are what the next stage reads, not what the user is handed)
    if (ctx.layout.tp_mesh is None or not ctx.config.gather_outputs or ctx.propagation is None
            or ctx.stage_program):
        return gm
    output = next(n for n in gm.graph.nodes if n.op == "output")
    gathered = []
    for position, node in enumerate(output.all_input_nodes):
        placements = ctx.propagation.placements.get(node.name, ())
        value = node.meta.get("val")
        if not any(isinstance(p, SHARDS) for p in placements) or not isinstance(value, torch.Tensor):
            continue
        size = math.prod(compat.size_hint(s) for s in value.shape) * value.dtype.itemsize   # (symbolic: as traced)
        gathered.append((size, f"output {position}: {str(value.dtype).replace('torch.', '')}{list(value.shape)}, "
                               f"{_bytes(size)}, from {_where(node)}"))
    if gathered:
        total = sum(size for size, _ in gathered)
        warnings.warn(
            f"dynshard: this program returns {len(gathered)} tensor(s) split across the plan unit's ranks and "
            f"gathers them whole on every rank at every step ({_bytes(total)} per step): "
            f"{'; '.join(text for _, text in gathered)}. If the training loop does not read them, {FIX}",
            stacklevel=2)
    return gm


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _where(node: fx.Node) -> str:
    """``file.py:line `code``` from the node's stack trace."""
    line = source_line(node)
    match = re.match(r'File "([^"]+)", line (\d+), in [^:]+: (.*)', line)
    return f"{os.path.basename(match[1])}:{match[2]} `{match[3]}`" if match else line
