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
    return compat.is_backend(compat.compiling_backend(), BACKEND_NAME)


def compiled_with_dynshard(module: torch.nn.Module) -> bool:
    """Whether ``module`` was compiled (wrapped or in place) with dynshard as its backend."""
    return compat.is_backend(compat.module_backend(module), BACKEND_NAME)
