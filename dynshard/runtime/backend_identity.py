"""Whether a frame or module is compiled with dynshard's backend, known without importing it.

:mod:`dynshard.backend` is a later layer than the runtime (it imports the runtime). The runtime finds the
backend's function where ``torch.compile(backend="dynshard")`` finds it: in Dynamo's backend registry,
under the name of dynshard's ``torch_dynamo_backends`` entry point (pyproject.toml).
"""

from __future__ import annotations

import torch

from .. import compat

BACKEND_NAME = "dynshard"


def compiling_for_dynshard() -> bool:
    """Whether the frame Dynamo is compiling now is compiled for dynshard (False outside a compile)."""
    return _is_dynshard(compat.compiling_backend())


def compiled_with_dynshard(module: torch.nn.Module) -> bool:
    """Whether ``module`` was compiled (wrapped or in place) with dynshard as its backend."""
    return _is_dynshard(compat.module_backend(module))


def _is_dynshard(backend) -> bool:
    """Whether ``backend`` (as ``compat.compiling_backend`` or ``compat.module_backend`` give it) is the backend
    registered as dynshard's."""
    return backend is not None and backend is compat.registered_backend(BACKEND_NAME)
