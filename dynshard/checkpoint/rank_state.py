"""Where each tensor of a rank's own state dicts sits, carried in those state dicts (for offline merging).

A rank's ``model.state_dict()`` and ``optimizer.state_dict()`` hold its shards (tp pieces, ZeRO rows with
their padding). To merge them later without the job, each says where its tensors sit, as nnScaler's
per-rank state dicts do:

- **Model: in the state dict's ``_metadata``**, torch's own per-module metadata (where each module's
  ``version`` is kept). A state-dict post-hook on the compiled module adds, in that module's
  ``state_dict._metadata[<module prefix>]``, ``"dynshard_rank_state": {"format", "rank", "world_size",
  "tensors": {name: info}}``, where ``info`` gives the global shape, the placements in the plan unit, the
  unit size and the ZeRO rows of each tagged tensor (names relative to that module; untagged tensors are
  whole on every rank). The keys and values stay exactly the original module's, so code that reads
  ``state_dict()`` as tensors, DCP and ``collect_state_dict`` see nothing new, and ``load_state_dict``
  of a rank's own state dict on that rank works with ``strict=True`` without any load hook (torch passes
  the metadata to ``_load_from_state_dict``, which reads only ``version``). ``torch.save`` /
  ``torch.load`` (also ``weights_only=True``: plain types only) keep ``_metadata``; a dict rebuilt from
  the items (``{k: v for ...}``) loses it, and :func:`.merged.merge_state_dicts` then says so.
- **A plain model refuses a rank's pieces with the fix.** When the entry holds split tensors (tp shards, ZeRO-3
  rows), the module's ``_metadata`` value is a :class:`RankPiecesMetadata` (a ``dict``, pickled as one, allowed
  for ``weights_only`` loads once dynshard is imported). ``Module._load_from_state_dict`` reads
  ``local_metadata.get("assign_to_params_buffers")`` after the module's load pre-hooks and before it compares
  any size: the hooked module's pre-hook checks that it stores exactly the pieces the entry describes and
  claims the entry, and an unclaimed entry raises :class:`RankPiecesError`, which says what to call to get the
  whole model. Without it the plain model's ``load_state_dict(torch.load(f))`` fails on sizes and names no fix,
  and a rank loading another rank's file under the same plan would load the wrong pieces without a word.
- **Optimizer: one more key.** A state-dict post-hook adds ``"dynshard_rank_state": {"format", "rank",
  "world_size", "params": {index: info}}`` beside ``state`` and ``param_groups`` (torch's
  ``Optimizer.load_state_dict`` reads only those two; a load pre-hook removes it anyway).
- **Installation.** The module hook goes on the modules of the frame that dynshard compiles (the module
  given to ``torch.compile``, found as :mod:`..runtime.materialize` finds it), when its program is built
  (:func:`hook_module` is in ``runtime.program.FRAME_MODULE_HOOKS``, added when this module is imported);
  the optimizer hooks go on any optimizer that steps with dynshard's tagged parameters (a global step
  pre-hook registered when this module is imported). The helpers of :mod:`.merged` also install them on
  the model and optimizer they are given.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.program import FRAME_MODULE_HOOKS
from ..runtime.sharding import SHARDS, ShardTag, get_tag

MARK = "dynshard_rank_state"        # in a module's state-dict metadata; beside "state" in an optimizer's
OPTIM_KEY = MARK
FORMAT = 1
_HOOKED = "_dynshard_rank_state_hooks"


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- where one tensor sits ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tagged tensor's storage over the ranks, in plain values (no process group needed).

    ``placements``: per mesh dimension of the plan unit (``"tp"``: ranks ``k * plan_ngpus + c`` have
    coordinate ``c``), ``("tp", "shard", dim, blocks)`` (``blocks`` > 1: a ``_StridedShard``) or
    ``("tp", "replicate")``. ``zero``: ``(level, group_size, ngroups, rows)`` of
    the ZeRO rows of the tp-local tensor, or None.
    """

    shape: tuple[int, ...]
    world_size: int
    plan_ngpus: int
    placements: tuple[tuple, ...]
    zero: tuple[int, int, int, int] | None

    @classmethod
    def of(cls, tag: ShardTag) -> "TensorInfo":
        if getattr(tag, "owner", None) is not None or getattr(tag.layout, "pp_size", 1) != 1:
            raise NotImplementedError(f"dynshard: {tag.fqn} belongs to a pipeline stage; merged and deduplicated "
                                      "state dicts cover tp, dp and ZeRO layouts (use dynshard.checkpoint.save)")
        placements = []
        for dim_name, placement in zip(tag.layout.placement_dims, tag.placements):
            if dim_name != "tp":
                raise NotImplementedError(f"dynshard: {tag.fqn} is placed on mesh dimension {dim_name!r}")
            if isinstance(placement, SHARDS):
                placements.append((dim_name, "shard", placement.dim, getattr(placement, "split_factor", 1)))
            elif isinstance(placement, Replicate):
                placements.append((dim_name, "replicate"))
            else:
                raise NotImplementedError(f"dynshard: {tag.fqn} is stored as {placement}")
        zero = None
        if tag.zero is not None:
            zero = (tag.zero.level, tag.zero.group_size, tag.zero.ngroups, tag.zero.rows)
        return cls(shape=tuple(tag.global_shape), world_size=tag.layout.world_size,
                   plan_ngpus=tag.layout.plan_ngpus, placements=tuple(placements), zero=zero)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "world_size": self.world_size, "plan_ngpus": self.plan_ngpus,
                "placements": [list(p) for p in self.placements],
                "zero": list(self.zero) if self.zero is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorInfo":
        if "unsupported" in d:
            raise ValueError(d["unsupported"])
        return cls(shape=tuple(d["shape"]), world_size=int(d["world_size"]), plan_ngpus=int(d["plan_ngpus"]),
                   placements=tuple(tuple(p) for p in d["placements"]),
                   zero=tuple(d["zero"]) if d["zero"] is not None else None)

    @property
    def shards(self) -> list[tuple[int, int, int]]:
        """(tensor dim, blocks, parts) of each split placement (on the unit's "tp" mesh), in order."""
        return [(p[2], p[3], self.plan_ngpus) for p in self.placements if p[1] == "shard"]

    @property
    def is_split(self) -> bool:
        return bool(self.shards) or self.zero is not None

    def piece(self, rank: int) -> tuple[tuple[int, ...], int]:
        """Which piece ``rank`` stores: its coordinates along the split placements and its ZeRO rank."""
        coords = tuple(rank % self.plan_ngpus for _ in self.shards)
        zero_rank = (rank // self.plan_ngpus) % self.zero[1] if self.zero is not None else 0
        return coords, zero_rank

    def owner(self, piece: tuple[tuple[int, ...], int]) -> int:
        """The lowest rank storing ``piece`` (coordinate 0 on every replicated mesh dimension)."""
        coords, zero_rank = piece
        return zero_rank * self.plan_ngpus + (coords[0] if coords else 0)

    def pieces(self) -> list[tuple[tuple[int, ...], int]]:
        """Every distinct piece, in order (tp coordinates major, ZeRO rank minor)."""
        coords = itertools.product(*(range(parts) for *_, parts in self.shards))
        zero_ranks = range(self.zero[1]) if self.zero is not None else (0,)
        return [(c, z) for c in coords for z in zero_ranks]

    def replica_classes(self) -> list[list[int]]:
        """The ranks partitioned by the piece they store (each class sorted, its owner first)."""
        classes: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            classes.setdefault(self.piece(rank), []).append(rank)
        return sorted(classes.values())

    def stored_shape(self) -> tuple[int, ...]:
        dims = list(self.shape)
        for dim, _, parts in self.shards:
            dims[dim] //= parts
        if self.zero is not None:
            dims[0] = -(-self.zero[3] // self.zero[1])
        return tuple(dims)

    def assemble(self, stored: Mapping[tuple[tuple[int, ...], int], torch.Tensor]) -> torch.Tensor:
        """The global tensor from one stored tensor per piece (what :func:`..runtime.sharding.stored_piece`
        cut, inverted: ZeRO rows concatenated and unpadded, then the tp shards put back in order)."""
        tp_local: dict[tuple[int, ...], torch.Tensor] = {}
        for coords in itertools.product(*(range(parts) for *_, parts in self.shards)):
            if self.zero is None:
                tp_local[coords] = stored[(coords, 0)]
            else:
                rows = torch.cat([stored[(coords, z)] for z in range(self.zero[1])])
                tp_local[coords] = rows.narrow(0, 0, self.zero[3])
        return _unshard(tp_local, self.shards)


def _unshard(pieces: dict[tuple[int, ...], torch.Tensor], shards: list[tuple[int, int, int]]) -> torch.Tensor:
    """Invert ``local_shard``: the last split placement first, each block of a strided shard in turn."""
    if not shards:
        return pieces[()]
    *rest, (dim, blocks, parts) = shards
    joined = {}
    for prefix in itertools.product(*(range(p) for *_, p in rest)):
        mine = [pieces[prefix + (c,)] for c in range(parts)]
        joined[prefix] = torch.cat([part.chunk(blocks, dim)[b] for b in range(blocks) for part in mine], dim)
    return _unshard(joined, rest)


def info_of(tensor: torch.Tensor) -> TensorInfo | None:
    tag = get_tag(tensor)
    return TensorInfo.of(tag) if tag is not None else None


# -- the model's entry ---------------------------------------------------------------------------------

def _named_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def module_entry(module: torch.nn.Module) -> dict[str, Any] | None:
    """Where ``module``'s tagged tensors sit (names relative to it), or None when none is tagged."""
    tensors: dict[str, Any] = {}
    for name, tensor in _named_tensors(module):
        try:
            info = info_of(tensor)
        except NotImplementedError as error:      # state_dict() itself must not fail: the merge reports it
            tensors[name] = {"unsupported": str(error)}
            continue
        if info is not None:
            tensors[name] = info.to_dict()
    if not tensors:
        return None
    rank, world = rank_and_world()
    return {"format": FORMAT, "rank": rank, "world_size": world, "tensors": tensors}


class RankPiecesError(ValueError):
    """A rank's own state dict (its pieces of split tensors) loaded where those pieces do not belong."""


_FIX = ("To get the whole model: on every rank, call dynshard.gather_state_dict(model) (the whole state dict on "
        "rank 0, one tensor at a time) and save that on rank 0, or model.save_pretrained(dir) for a transformers "
        "model; from files each rank saved, dynshard.merge_state_dicts([rank 0's, rank 1's, ...]) gives the "
        "whole state dict offline")


class RankPiecesMetadata(dict):
    """A hooked module's ``_metadata`` value whose entry holds split tensors: loading it into a module that
    has not claimed it (see the module docstring) raises :class:`RankPiecesError`."""

    def __reduce__(self):
        return (RankPiecesMetadata, (dict(self),))

    def get(self, key, default=None):
        if key == "assign_to_params_buffers":        # Module._load_from_state_dict, after the pre-hooks
            claimed, self.__dict__["claimed"] = self.__dict__.get("claimed", False), False
            if not claimed:
                raise RankPiecesError(_plain_load_message(self[MARK]))
        return super().get(key, default)


def _split_names(entry: Mapping[str, Any]) -> list[tuple[str, TensorInfo]]:
    return [(name, info) for name, d in entry["tensors"].items() if "unsupported" not in d
            for info in [TensorInfo.from_dict(d)] if info.is_split]


def _plain_load_message(entry: Mapping[str, Any]) -> str:
    name, info = _split_names(entry)[0]
    return (f"dynshard: this state dict holds rank {entry['rank']}'s pieces of a model whose tensors are split "
            f"over {entry['world_size']} ranks ({name} is stored as {list(info.stored_shape())} of "
            f"{list(info.shape)}), so a module holding whole tensors cannot load it. {_FIX}.")


def _add_entry(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
    entry = module_entry(module)
    if entry is None:
        return
    metadata = getattr(state_dict, "_metadata", {})
    own = prefix[:-1]
    for name, meta in metadata.items():      # a hooked submodule's entry: this one covers its tensors
        if name != own and name.startswith(prefix) and isinstance(meta, dict) and MARK in meta:
            metadata[name] = {k: v for k, v in meta.items() if k != MARK}
    local_metadata[MARK] = entry
    if _split_names(entry) and own in metadata:
        metadata[own] = RankPiecesMetadata(local_metadata)


def _claim_pieces(module: torch.nn.Module, state_dict, prefix: str, local_metadata, *args) -> None:
    """A load pre-hook of the hooked module: its own pieces, on a rank storing them, are its to load."""
    if not isinstance(local_metadata, RankPiecesMetadata):
        return
    entry, (rank, _) = local_metadata[MARK], rank_and_world()
    tensors = dict(_named_tensors(module))
    for name, saved in _split_names(entry):
        try:
            here = info_of(tensors[name]) if name in tensors else None
        except NotImplementedError:
            continue
        if here != saved:
            now = "whole" if here is None else f"stored as {list(here.stored_shape())}"
            raise RankPiecesError(
                f"dynshard: this state dict holds rank {entry['rank']}'s pieces of {name} (stored as "
                f"{list(saved.stored_shape())} of {list(saved.shape)}), saved under another plan or world size; this "
                f"model's {name} is {now} (a rank's own state dict loads after the first step, under the plan and "
                f"world size that saved it). {_FIX}; dynshard.load_merged_state_dicts(model, whole) loads a whole "
                "state dict under any plan.")
        if saved.piece(entry["rank"]) != saved.piece(rank):
            raise RankPiecesError(
                f"dynshard: this state dict holds rank {entry['rank']}'s pieces of {name}, and rank {rank} stores "
                f"other pieces of it: each rank loads the state dict it saved itself. {_FIX}; "
                "dynshard.load_merged_state_dicts(model, whole) loads a whole state dict on every rank.")
    local_metadata.__dict__["claimed"] = True


def hook_module(module: torch.nn.Module) -> None:
    """Make ``module.state_dict()`` say where its tensors sit, and its loads check them; idempotent."""
    if getattr(module, _HOOKED, False):
        return
    module.register_state_dict_post_hook(_add_entry)
    module.register_load_state_dict_pre_hook(_claim_pieces)
    setattr(module, _HOOKED, True)


def entries_of(state_dict: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(key prefix, entry) of each hooked module in a model state dict's ``_metadata``."""
    found = []
    for name, meta in (getattr(state_dict, "_metadata", None) or {}).items():
        if isinstance(meta, Mapping) and MARK in meta:
            found.append((f"{name}." if name else "", meta[MARK]))
    return found


# -- the optimizer's entry -----------------------------------------------------------------------------

def indexed_params(optimizer: torch.optim.Optimizer,
                   packed_groups: list[Mapping[str, Any]]) -> list[tuple[int, torch.Tensor]]:
    """(index in a state dict's ``param_groups``, parameter) pairs, as ``Optimizer.load_state_dict`` pairs them."""
    if len(packed_groups) != len(optimizer.param_groups):
        raise ValueError("dynshard: the optimizer state dict has a different number of parameter groups")
    pairs = []
    for group, packed in zip(optimizer.param_groups, packed_groups):
        if len(group["params"]) != len(packed["params"]):
            raise ValueError("dynshard: a parameter group of the optimizer state dict has another size")
        pairs += list(zip(packed["params"], group["params"]))
    return pairs


def _add_optimizer_entry(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    params: dict[int, Any] = {}
    for index, param in indexed_params(optimizer, state_dict["param_groups"]):
        try:
            info = info_of(param)
        except NotImplementedError as error:
            params[index] = {"unsupported": str(error)}
            continue
        if info is not None:
            params[index] = info.to_dict()
    if params:
        rank, world = rank_and_world()
        state_dict[OPTIM_KEY] = {"format": FORMAT, "rank": rank, "world_size": world, "params": params}


def _take_optimizer_entry(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state_dict.items() if k != OPTIM_KEY}


def hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` carry the entry; idempotent."""
    if getattr(optimizer, _HOOKED, False):
        return
    optimizer.register_state_dict_post_hook(_add_optimizer_entry)
    optimizer.register_load_state_dict_pre_hook(_take_optimizer_entry)
    setattr(optimizer, _HOOKED, True)


def _watch_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, _HOOKED, False):
        return
    if any(get_tag(p) is not None for group in optimizer.param_groups for p in group["params"]):
        hook_optimizer(optimizer)


_STEP_HOOK = register_optimizer_step_pre_hook(_watch_optimizer)
torch.serialization.add_safe_globals([RankPiecesMetadata])      # torch.load(weights_only=True) of a rank's file
FRAME_MODULE_HOOKS.append(hook_module)     # each program's frame modules, when the program is built
