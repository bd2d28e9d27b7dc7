"""Process groups and the device mesh, from the torchrun environment.

Ranks are laid out as nnScaler's plan units: ranks ``[k * plan_ngpus, (k + 1) * plan_ngpus)`` form unit
``k`` and partition the model among themselves; units are data-parallel replicas (mesh dimension "dp"):
each unit sees its own batch and gradients are averaged over "dp" as DDP does. Inside a unit, pipeline
stages (mesh dimension "pp", ``pp_size`` of them one after another) each hold ``plan_ngpus / pp_size``
ranks that split the stage's tensors (mesh dimension "tp"): unit rank ``pp_rank * tp_size + tp_rank``.
Mesh dimensions of size 1 are left out, so a pure data-parallel job has a 1-D "dp" mesh and a single
unit a 1-D "tp" mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import compat
from .job import current_job

MESH_DIMS = ("dp", "pp", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this rank sits: world size, plan unit size and the device mesh over both."""

    world_size: int
    rank: int
    plan_ngpus: int
    device_type: str
    mesh: DeviceMesh | None
    pp_size: int = 1          # pipeline ranks in a unit (policies "pp" and "hybrid")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.plan_ngpus

    @property
    def tp_size(self) -> int:
        return self.plan_ngpus // self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.plan_ngpus

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank % self.plan_ngpus // self.tp_size

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks of this unit at this rank's tp coordinate, one per pipeline rank."""
        return self.mesh.get_group("pp") if "pp" in self.dim_names else None

    @functools.cached_property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names) if self.mesh is not None else ()

    @functools.cached_property      # (slicing a DeviceMesh builds a new one: planning asks thousands of times)
    def tp_mesh(self) -> DeviceMesh | None:
        """The mesh that tensors are placed on: the ranks of this plan unit (None if a unit is 1 rank)."""
        return self.mesh["tp"] if "tp" in self.dim_names else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same part of the model in other units (gradients are averaged here)."""
        return self.mesh.get_group("dp") if "dp" in self.dim_names else None

    @functools.cached_property
    def placement_dims(self) -> tuple[str, ...]:
        """Placements are given per dimension of ``tp_mesh``: ("tp",) or () when a unit is one rank."""
        return ("tp",) if self.tp_mesh is not None else ()

    def size(self, dim: str) -> int:
        return {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size}[dim]

    def coordinate(self, dim: str) -> int:
        return {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}[dim]

    def group_dim(self, group_name: str) -> str:
        """The mesh dimension whose process group is called ``group_name``."""
        for name in self.dim_names:
            if self.mesh.get_group(name).group_name == group_name:
                return name
        named = current_job().part(_JobMeshes).group_names
        if group_name in named:
            return named[group_name]
        return "world" if group_name == dist.group.WORLD.group_name else group_name

    def token(self) -> str:
        return f"world={self.world_size},plan={self.plan_ngpus},pp={self.pp_size},device={self.device_type}"


class _JobMeshes:
    """The layouts (their meshes) made in a job, and what the groups made after them are: a part of the job,
    since they hold its process groups (group names start again with a new default group)."""

    def __init__(self) -> None:
        self.layouts: dict[tuple[int, str, int, int], Layout] = {}
        self.group_names: dict[str, str] = {}      # process groups created after the mesh (ZeRO groups) -> dim

    def end_job(self) -> None:
        if self.layouts:        # (DTensor's cached answers hold specs on these meshes)
            compat.forget_sharding_answers()


def register_group_name(group_name: str, dim: str) -> None:
    """Report collectives on ``group_name`` under ``dim`` (explain, tests)."""
    current_job().part(_JobMeshes).group_names[group_name] = dim


def ensure_process_group(device_type: str) -> None:
    """Initialise the default process group from the torchrun environment if the user did not."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    # torchrun (2.13) hands every attempt of a restarted group its agent's store, in which the default
    # init keys the workers' addresses without the attempt: a restarted group would read the dead workers'
    # (pytorch#135712, "Gloo connectFullMesh failed"). Scope this attempt's keys by the restart count.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"dynshard/attempt{attempt}", store), rank=rank,
                            world_size=world)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def layout_for(plan_ngpus: int, device_type: str, pp_size: int = 1) -> Layout:
    """The layout for a plan of ``plan_ngpus`` ranks per unit, ``pp_size`` pipeline ranks of them; built
    once per job and world (it creates groups)."""
    ensure_process_group(device_type)
    layouts = current_job().part(_JobMeshes).layouts
    key = (plan_ngpus, device_type, pp_size, world_size())
    if key not in layouts:
        layouts[key] = _layout(*key)
    return layouts[key]


def _layout(plan_ngpus: int, device_type: str, pp_size: int, world: int) -> Layout:
    rank = dist.get_rank() if dist.is_initialized() else 0
    sizes = {"dp": world // plan_ngpus, "pp": pp_size, "tp": plan_ngpus // pp_size}
    names = tuple(name for name in MESH_DIMS if sizes[name] > 1)
    mesh = None
    if names:
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    return Layout(world_size=world, rank=rank, plan_ngpus=plan_ngpus, device_type=device_type, mesh=mesh,
                  pp_size=pp_size)


@dataclasses.dataclass(frozen=True)
class PlanningLayout(Layout):
    """A layout to plan for, with no process group behind it: rank 0 of a ``world_size``-rank job whose
    tp mesh is an abstract one (:func:`dynshard.compat.abstract_device_mesh`). Sharding propagation runs on
    it; nothing communicates. An automatic policy plans candidate layouts this way on one rank of a job,
    whatever the job's own process group is."""

    @functools.cached_property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(name for name in MESH_DIMS if self.size(name) > 1)

    @functools.cached_property
    def tp_mesh(self) -> DeviceMesh | None:
        return compat.planning_device_mesh(self.device_type, self.tp_size, "dynshard_planning_tp") \
            if self.tp_size > 1 else None

    @property
    def dp_group(self) -> None:
        return None

    @property
    def pp_group(self) -> None:
        return None


def planning_layout(world: int, plan_ngpus: int, device_type: str, pp_size: int = 1) -> PlanningLayout:
    return PlanningLayout(world_size=world, rank=0, plan_ngpus=plan_ngpus, device_type=device_type, mesh=None,
                          pp_size=pp_size)
