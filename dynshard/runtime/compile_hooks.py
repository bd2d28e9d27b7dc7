"""Work done around Dynamo's compile of a frame for one backend: a start before Dynamo traces the frame, an end
once it has compiled it (on Dynamo's compile callbacks, reached through compat)."""

from __future__ import annotations

from typing import Callable

from .. import compat

_HOOKS: dict[int, tuple[Callable, Callable]] = {}


def around_dynamo_compiles(start: Callable[[], None], end: Callable[[], None],
                           backend: Callable | None = None) -> None:
    """Run ``start()`` before Dynamo traces a frame for ``backend`` and ``end()`` after it has compiled
    it (Dynamo's compile callbacks, trigger DYNAMO: not aot_autograd's lazy backward compile).

    ``backend`` defaults to the backend calling this (it must be called from inside a compile). Frames
    compiled by other backends (``torch.compile(opt.step)``) are left alone; where the frame's backend
    cannot be found, ``start()`` runs for every frame. ``torch._dynamo.reset()`` drops Dynamo's
    callbacks: call this again (every backend call does), and they are registered again.
    """
    hooks = _HOOKS.get(id(start))
    if hooks is None:
        own = backend if backend is not None else compat.compiling_backend()
        hooks = _HOOKS[id(start)] = _frame_hooks(start, end, own)
    compat.register_compile_start(hooks[0])
    compat.register_compile_end(hooks[1])


def _frame_hooks(start: Callable[[], None], end: Callable[[], None], own: Callable | None) -> tuple[Callable, Callable]:
    started = []

    def on_start(args) -> None:
        if not compat.starts_frame_compile(args):
            return
        frame_backend = compat.compiling_backend() if own is not None else None
        if frame_backend is None or frame_backend is own:
            started.append(True)
            start()

    def on_end(args) -> None:
        if compat.starts_frame_compile(args) and started:
            started.clear()
            end()

    return on_start, on_end
