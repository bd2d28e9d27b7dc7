"""DTensor's implicit replication, kept as it was: while Dynamo traces a frame for dynshard, plain tensors
next to DTensors count as replicated (see :func:`dynshard.backend.capture.install_capture_hooks`).

``torch.distributed.tensor.experimental.implicit_replication()`` switches the flag off on exit whatever it
was before; a user's own ``implicit_replication()`` around a compiled call must outlive dynshard's compile,
so the dispatcher's flag is saved and restored here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def tensors_as_replicated() -> Iterator[None]:
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before
