"""What each rank runs in the mesh-coordinate tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.utils._python_dispatch import TorchDispatchMode

import dynshard
from dynshard import compat
from dynshard.backend import job_plans
from models import GPT, GPTConfig, gpt_batch

TABLE_ROWS = (8, 7, 3, 1)     # even, uneven, and a table with fewer rows than ranks (empty shards)


def masked_indices(rank: int, world: int) -> dict:
    """torch's ``_MaskPartial`` masking and dynshard's (offset read at run time) on the same indices."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    # ranks in descending order: a rank's index in the group (sorted) is not its coordinate, torch's is kept
    descending = DeviceMesh("cpu", torch.arange(world - 1, -1, -1))
    results = {}
    for rows in TABLE_ROWS:
        ids = torch.randint(0, rows, (5, 6), generator=torch.Generator().manual_seed(rows))
        results[(rows, "ids")] = _both_ways(ids, rows, mesh)
        results[(rows, "int32 scalar")] = _both_ways(ids[0, 0].to(torch.int32), rows, mesh)
        results[(rows, "descending mesh")] = _both_ways(ids, rows, descending)
    return results


class _OpsCalled(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _both_ways(ids: torch.Tensor, rows: int, mesh) -> list:
    """[(masked, mask) by torch, (masked, mask, whether the offset was read at run time) by dynshard]"""
    per_way = []
    for read_at_run_time in (False, True):
        placement = _MaskPartial(offset_shape=torch.Size([rows, 4]), offset_dim=0)
        with compat.mask_offsets_read_at_run_time() if read_at_run_time else contextlib.nullcontext(), \
                _OpsCalled() as ops:
            masked = placement._partition_value(ids, mesh, 0)
        per_way.append((masked, placement.mask_buffer.data))
    return [*per_way[:1], (*per_way[1], "dynshard.mesh_coordinate.default" in ops.names)]


def tp_programs(rank: int, world: int, compiler: str) -> dict:
    """One training step of the test GPT under ``tp`` (vocab-parallel embedding, head and loss): the code
    of the forward and backward graphs this rank compiled."""
    cfg = GPTConfig()
    model = GPT(cfg)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=world, compiler=compiler))
    compiled(*gpt_batch(cfg, 2, 0)).backward()
    report = dynshard.explain(compiled)
    return dict(job_plans().get(report.programs[0].key).program.graphs)
