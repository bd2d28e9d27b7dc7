"""Pipeline parallelism at run time: schedules, the per-rank executor, stage ownership, train_step."""

from .steps import infer_step, train_step

__all__ = ["infer_step", "train_step"]
