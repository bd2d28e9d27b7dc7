"""ZeRO storage: a parameter's rows split over the data-parallel ranks of its zero group.

At every level (1, 2, 3) a ZeRO-sharded parameter holds, at rest, a block of rows of its tensor-parallel
shard: rows ``[r * shard_rows, (r + 1) * shard_rows)`` of the tp-local tensor padded with zero rows to
``group_size * shard_rows``, where ``r`` is this rank's index in its zero group. Every rank of a group
holds the same shape (the padding goes to the last ranks), so every rank compiles the same program.
Padding rows have zero gradients and so stay zero under SGD, Adam and AdamW.

The data-parallel ranks (one per plan unit, at the same tp coordinate) form ``zero_ngroups`` contiguous
groups of ``group_size`` ranks (nnScaler's layout): a parameter is sharded inside a group and replicated
across groups (HSDP).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .job import current_job
from .mesh import Layout, register_group_name


@dataclasses.dataclass(frozen=True)
class ZeroSpec:
    """How one tensor's (tp-local) rows are stored over its zero group."""

    level: int          # 1, 2 or 3
    group_size: int     # ranks sharing the rows
    ngroups: int        # groups holding replicas of the rows
    rows: int           # rows of the tp-local tensor (unpadded)
    reduce_scatter: bool = True   # gradients reduce-scattered; False: all-reduced and sliced (level 1)

    @property
    def shard_rows(self) -> int:
        return -(-self.rows // self.group_size)

    @property
    def padded_rows(self) -> int:
        return self.shard_rows * self.group_size

    def stored_shape(self, tp_local: torch.Size) -> torch.Size:
        return torch.Size((self.shard_rows, *tp_local[1:]))

    def describe(self) -> str:
        groups = f" x{self.ngroups} groups" if self.ngroups > 1 else ""
        pad = f", {self.padded_rows - self.rows} padding rows" if self.padded_rows != self.rows else ""
        return f"zero{self.level}=S(0)/{self.group_size}{groups}{pad}"


def zero_spec(level: int, layout: Layout, ngroups: int, tp_local: torch.Size,
              use_reduce_scatter: bool = False) -> ZeroSpec | None:
    """The storage of a trainable tensor of tp-local shape ``tp_local``, or None when it stays whole
    (zero off, one data-parallel unit, or a scalar)."""
    group_size = layout.dp_size // ngroups
    if not level or group_size < 2 or not len(tp_local):
        return None
    return ZeroSpec(level=level, group_size=group_size, ngroups=ngroups, rows=tp_local[0],
                    reduce_scatter=level >= 2 or use_reduce_scatter)


@dataclasses.dataclass(frozen=True)
class ZeroGroups:
    """The process groups of one zero layout, seen from this rank."""

    shard: dist.ProcessGroup          # ranks that split the rows
    replicas: dist.ProcessGroup | None  # ranks holding the same rows in the other groups
    dp: dist.ProcessGroup             # all data-parallel ranks (shard x replicas)
    rank: int                         # this rank's index in ``shard``

    @property
    def shard_name(self) -> str:
        return self.shard.group_name


class _ZeroGroupsMade(dict):
    """The zero groups made by (layout, ngroups): a part of the job, whose groups they are."""


def zero_groups(layout: Layout, ngroups: int) -> ZeroGroups:
    """Created once per (layout, ngroups) and job on every rank (creating groups is collective)."""
    made = current_job().part(_ZeroGroupsMade)
    if (layout, ngroups) not in made:
        made[layout, ngroups] = _make_zero_groups(layout, ngroups)
    return made[layout, ngroups]


def _make_zero_groups(layout: Layout, ngroups: int) -> ZeroGroups:
    if ngroups == 1:
        return ZeroGroups(shard=layout.dp_group, replicas=None, dp=layout.dp_group,
                          rank=layout.dp_rank)
    group_size = layout.dp_size // ngroups
    ranks = torch.arange(layout.world_size).reshape(ngroups, group_size, layout.plan_ngpus)
    mesh = DeviceMesh(layout.device_type, ranks, mesh_dim_names=("zero_replicas", "zero", "tp"))
    shard, replicas = mesh.get_group("zero"), mesh.get_group("zero_replicas")
    register_group_name(shard.group_name, "zero")
    register_group_name(replicas.group_name, "zero_replicas")
    return ZeroGroups(shard=shard, replicas=replicas, dp=layout.dp_group,
                      rank=layout.dp_rank % group_size)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def shard_rows(tp_local: torch.Tensor, spec: ZeroSpec, rank: int) -> torch.Tensor:
    """This rank's stored rows of a whole tp-local tensor (no communication)."""
    padded = pad_rows(tp_local, spec.padded_rows)
    return padded.narrow(0, rank * spec.shard_rows, spec.shard_rows).contiguous()


def gather_rows(stored: torch.Tensor, spec: ZeroSpec, groups: ZeroGroups) -> torch.Tensor:
    """The whole tp-local tensor from this rank's stored rows (an all-gather over the zero group)."""
    out = stored.new_empty((spec.padded_rows, *stored.shape[1:]))
    dist.all_gather_single(out, stored.contiguous(), group=groups.shard)
    return out.narrow(0, 0, spec.rows)
