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

from types import CodeType
from typing import Callable

from torch._dynamo import config as dynamo_config
from torch._dynamo import convert_frame

from .frames import compiling_frame

_CALLBACKS: list[Callable[[str, int, CodeType | None, str | None], None]] = []


def on_recompile_limit(callback: Callable[[str, int, CodeType | None, str | None], None]) -> None:
    """Call ``callback(limit_type, limit, code, reason)`` whenever Dynamo reaches a recompile limit, before it
    runs the frame eagerly: the limit's name in Dynamo's config ("recompile_limit" or
    "accumulated_recompile_limit") and its value, the frame's code object, and the guard that failed last as
    Dynamo words it (``_compile``'s ``recompile_reason``, e.g. "0/7: temperature == 1.7" and the source line);
    None where Dynamo's frame does not say. An exception the callback raises stops that call. Idempotent per
    callback."""
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)
    current = convert_frame.exceeds_recompile_limit
    if getattr(current, "_dynshard_wrapped", False):
        return

    def exceeds_recompile_limit(cache_size, compile_id):
        exceeded, limit_type = current(cache_size, compile_id)
        if exceeded:
            frame = compiling_frame() or {}
            reason = frame.get("recompile_reason")
            details = (limit_type, getattr(dynamo_config, limit_type, -1), frame.get("code"),
                       reason if isinstance(reason, str) else None)
            for hook in list(_CALLBACKS):
                hook(*details)
        return exceeded, limit_type

    exceeds_recompile_limit._dynshard_wrapped = True
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit
