"""Plans keyed on what decides them: graph structure, global input shapes, config and world layout.

In memory a hit returns the compiled program itself (the re-trace that follows the in-place sharding of
parameters never compiles twice). On disk (``Config.cache_dir``) the placements are kept as JSON, so a
restarted job skips the policy search. The same JSON is what rank 0 sends the other ranks of a job (see
:class:`.agreement.PlanChannel`): a received plan and a stored one are installed alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import compat
from ..config import Config
from ..passes.context import ActivationPlacement
from ..runtime.mesh import Layout
from .capture import GraphInput


def plan_key(code: str, inputs: Sequence[GraphInput], config: Config, layout: Layout) -> str:
    parts = [code, *(inp.token() for inp in inputs), config.cache_token(), layout.token(),
             torch.__version__, modes_token()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def modes_token() -> str:
    """The ambient state that changes the traced program while Dynamo's graph stays the same: grad mode,
    autocast (aot_autograd applies it while tracing) and the default dtype (factory calls)."""
    autocast = ",".join(f"{device}:{dtype}" for device, dtype in sorted(compat.autocast_state().items()))
    return f"grad={torch.is_grad_enabled()} autocast={autocast or 'off'} default_dtype={torch.get_default_dtype()}"


class PlanCache:
    def __init__(self) -> None:
        self._memory: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self._memory.get(key)

    def put(self, key: str, plan: Any) -> None:
        self._memory[key] = plan

    def clear(self) -> None:
        self._memory.clear()

    # -- placements on disk -----------------------------------------------------------------------
    @staticmethod
    def load_text(config: Config, key: str) -> str | None:
        """The JSON text stored for ``key`` in ``cache_dir`` (placements, or a pipeline's stage cut), or None."""
        if not config.cache_dir:
            return None
        path = os.path.join(config.cache_dir, f"plan-{key}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read()

    @staticmethod
    def save_text(config: Config, key: str, text: str, layout: Layout) -> None:
        """Rank 0 keeps ``text`` for ``key`` in ``cache_dir`` (written atomically)."""
        if not config.cache_dir or layout.rank != 0:
            return
        os.makedirs(config.cache_dir, exist_ok=True)
        path = os.path.join(config.cache_dir, f"plan-{key}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def load_plan(self, config: Config, key: str) -> dict[str, Any] | None:
        """A stored plan (see :func:`decode_plan`), None when ``cache_dir`` holds none for ``key``."""
        text = self.load_text(config, key)
        return None if text is None else decode_plan(text)

    def save_plan(self, config: Config, key: str, placements: dict[int, tuple[Placement, ...]], over_dp: set[int],
                  constraints: dict[str, ActivationPlacement], layout: Layout) -> None:
        self.save_text(config, key, encode_plan(placements, over_dp, constraints), layout)


def encode_plan(placements: dict[int, tuple[Placement, ...]], over_dp: set[int],
                constraints: dict[str, ActivationPlacement]) -> str:
    """What the policy decided, as JSON text: kept in ``cache_dir`` and sent by rank 0 to the other ranks."""
    return json.dumps({"placements": {i: [_encode(p) for p in ps] for i, ps in placements.items()},
                       "over_dp": sorted(over_dp),
                       "constraints": {name: {"placements": [_encode(p) for p in c.placements],
                                              "readers": None if c.readers is None else list(c.readers)}
                                       for name, c in constraints.items()}})


def decode_plan(text: str) -> dict[str, Any]:
    """A plan from :func:`encode_plan`: each input's placements ("placements"), the inputs whose rows ZeRO
    splits over dp ("over_dp") and the activations the policy placed ("constraints")."""
    stored = json.loads(text)
    return {"placements": {int(i): _decode_all(ps) for i, ps in stored["placements"].items()},
            "over_dp": set(stored.get("over_dp", ())),
            "constraints": {name: ActivationPlacement(_decode_all(c["placements"]),
                                                      None if c["readers"] is None else tuple(c["readers"]))
                            for name, c in stored.get("constraints", {}).items()}}


def _decode_all(texts) -> tuple[Placement, ...]:
    return tuple(_decode(t) for t in texts)


def _encode(placement: Placement) -> str:
    if isinstance(placement, _StridedShard):
        return f"S{placement.dim}x{placement.split_factor}"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Partial):
        return f"P{placement.reduce_op}"
    if isinstance(placement, Replicate):
        return "R"
    raise ValueError(f"dynshard: cannot store placement {placement}")


def _decode(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text.startswith("S") and "x" in text:
        dim, blocks = text[1:].split("x")
        return _StridedShard(int(dim), split_factor=int(blocks))
    if text.startswith("S"):
        return Shard(int(text[1:]))
    return Partial(text[1:])
