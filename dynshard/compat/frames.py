"""The Dynamo compile on the Python call stack (``convert_frame._compile``'s arguments)."""

from __future__ import annotations

from typing import Any


def compiling_frame() -> dict[str, Any] | None:
    """The arguments of Dynamo's ``convert_frame._compile`` on the call stack (the frame's ``locals``,
    ``globals``, ``closure``, ``code``, and the ``compiler_fn`` it compiles for), or None outside a
    Dynamo compile: Dynamo hands ``compiler_fn`` to nothing else before the backend itself is called."""
    import sys

    from torch._dynamo import convert_frame

    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_compile"
                                     and frame.f_code.co_filename == convert_frame.__file__):
        frame = frame.f_back
    return frame.f_locals if frame is not None else None


def dynamo_frame_id() -> int | None:
    """The number Dynamo gave the code object it compiles now (one per code object, in the order this
    process first compiled them), or None outside a Dynamo compile."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else compile_id.frame_id
