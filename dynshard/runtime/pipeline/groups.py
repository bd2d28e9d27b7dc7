"""The ranks a pipeline runs on: the ranks of a plan unit are its pipeline ranks, units are data parallel.

The groups are the device mesh's (:func:`dynshard.runtime.mesh.layout_for`): under ``policy="pp"`` a
unit's ranks hold no tensor-parallel shards, so the mesh's inner dimension is the pipeline group.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..mesh import Layout


@dataclasses.dataclass(frozen=True)
class PipelineGroups:
    layout: Layout

    @property
    def pp_size(self) -> int:
        return self.layout.plan_ngpus

    @property
    def pp_rank(self) -> int:
        return self.layout.rank % self.layout.plan_ngpus

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.layout.mesh.get_group("tp") if "tp" in self.layout.dim_names else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.layout.dp_group

    def global_rank(self, pp_rank: int, unit: int | None = None) -> int:
        """The world rank of pipeline rank ``pp_rank`` in plan unit ``unit`` (default: this rank's)."""
        return (self.dp_rank if unit is None else unit) * self.layout.plan_ngpus + pp_rank
