"""Sharded, atomic checkpoints on torch.distributed.checkpoint (DCP) that load under any plan.

    dynshard.checkpoint.save(f"ckpt/step{step}", model, optimizer, extra={"step": step})
    extra = dynshard.checkpoint.load(dynshard.checkpoint.latest("ckpt"), model, optimizer)
"""

from .api import load, save
from .io import latest
from .pretrained import SavePretrainedError  # noqa: F401  (wraps transformers' saves when imported)
from .rank_state import RankPiecesError  # noqa: F401

__all__ = ["latest", "load", "save"]
