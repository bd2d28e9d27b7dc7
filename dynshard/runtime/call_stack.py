"""The objects running on the Python call stack, found from inside a hook they run."""

from __future__ import annotations

import sys
from typing import Any, Callable


def caller_self(predicate: Callable[[Any], bool], local: str | None = None) -> tuple[Any, Any]:
    """The innermost ``self`` on the Python call stack that satisfies ``predicate``, and the value of ``local``
    in the innermost frame of that object that has it ((None, None) if none): how a hook run inside a
    framework's method (transformers' ``Trainer.training_step``) finds the object running it and an argument
    of an outer call (``train(resume_from_checkpoint=...)``)."""
    frame, found, value = sys._getframe(1), None, None
    while frame is not None:
        candidate = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if candidate is not None and (candidate is found or found is None and predicate(candidate)):
            found = candidate
            if local is not None and local in frame.f_code.co_varnames:
                value = frame.f_locals.get(local)
                break
        frame = frame.f_back
    return found, value
