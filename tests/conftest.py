from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def fake_world():
    """This process as rank 0 of 2 on a process group that never communicates (pass-level tests)."""
    import torch.distributed as dist

    from dynshard import compat

    if not dist.is_initialized():
        compat.fake_process_group(2)
    yield 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
