"""Dynamo's recompile limit, seen where it is reached.

When a frame's cache holds ``torch._dynamo.config.recompile_limit`` entries and none admits a call, Dynamo
logs a warning and runs that call, and every frame it calls, eagerly (``FrameAction.RUN_ONLY``). A frame
compiled for dynshard must not: its parameters are shards, or whole replicas whose gradients only the
compiled backward reduces. ``convert_frame._compile`` looks up ``exceeds_recompile_limit`` in its module's
globals at every compile, so a wrapper there sees the limit reached before the eager run starts, inside
``_compile`` (whose locals name the frame and the guard that failed last), and an exception it raises reaches
the caller of the frame as it is (probed on torch 2.13).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from torch._dynamo import config as dynamo_config
from torch._dynamo import convert_frame

from .frames import compiling_frame

_CALLBACKS: list[Callable[["RecompileLimit"], None]] = []


@dataclasses.dataclass(frozen=True)
class RecompileLimit:
    """A frame Dynamo would run eagerly: which limit, its value, the function and the last failed guard."""

    limit_type: str              # "recompile_limit" or "accumulated_recompile_limit"
    limit: int
    function: str                # 'forward' (model.py:12)
    reason: str | None           # Dynamo's "0/7: temperature == 1.7", the guard that failed last


def _details(limit_type: str) -> RecompileLimit:
    frame = compiling_frame() or {}
    code = frame.get("code")
    where = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
    reason = frame.get("recompile_reason")
    if isinstance(reason, str):      # its first line, without the source line Dynamo appends after spaces and '#'
        reason = re.split(r"\s{2,}#", reason.split("\n")[0])[0].strip()
    return RecompileLimit(limit_type, getattr(dynamo_config, limit_type, -1), where,
                          reason if isinstance(reason, str) else None)


def on_recompile_limit(callback: Callable[[RecompileLimit], None]) -> None:
    """Call ``callback(limit)`` whenever Dynamo reaches a recompile limit, before it runs the frame eagerly;
    an exception the callback raises stops that call. Idempotent per callback."""
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)
    current = convert_frame.exceeds_recompile_limit
    if getattr(current, "_dynshard_wrapped", False):
        return

    def exceeds_recompile_limit(cache_size, compile_id):
        exceeded, limit_type = current(cache_size, compile_id)
        if exceeded:
            limit = _details(limit_type)
            for hook in list(_CALLBACKS):
                hook(limit)
        return exceeded, limit_type

    exceeds_recompile_limit._dynshard_wrapped = True
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit
