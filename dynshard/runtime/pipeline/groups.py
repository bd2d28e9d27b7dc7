"""The ranks a pipeline runs on: a plan unit's pipeline ranks (mesh dimension "pp"), each with its
tensor-parallel ranks (mesh dimension "tp", one rank under ``policy="pp"``); units are data parallel.
Transfers go between ranks of the same tp coordinate (:func:`dynshard.runtime.mesh.layout_for`)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..mesh import Layout


@dataclasses.dataclass(frozen=True)
class PipelineGroups:
    layout: Layout

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.layout.pp_group

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.layout.dp_group

    def global_rank(self, pp_rank: int, unit: int | None = None, tp_rank: int | None = None) -> int:
        """The world rank of pipeline rank ``pp_rank`` in plan unit ``unit`` at tp coordinate ``tp_rank``
        (defaults: this rank's)."""
        layout = self.layout
        tp_rank = layout.tp_rank if tp_rank is None else tp_rank
        return (self.dp_rank if unit is None else unit) * layout.plan_ngpus + pp_rank * layout.tp_size + tp_rank
