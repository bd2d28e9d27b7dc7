"""dynshard: a torch.compile backend that trains one ordinary PyTorch model on many processes.

    model = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="tp", plan_ngpus=2))
"""

from .backend.agreement import PlanMismatchError, PlanningFailedError
from .backend.capture import BackendFailedError, keep_floats_constant
from .backend.offline import plan
from .backend.planner import Planning, PlannerError
from .backend.shapes import SymbolicShapesError
from .config import Config, ConfigError
from .config.planner import planner
from .explain import Explanation, explain
from .planning import Plan, PlanFileError
from .autodist.profile import Profile, profile
from .policies import PlanBuilder, PlanError, tensor_parallel
from .runtime.accumulation import no_sync
from .runtime.grad_norm import clip_grad_norm_, route_torch_clip_grad_norm
from .runtime.grad_scaler import GradScaler
from .runtime.mesh import Layout
from .runtime.optimizer import ParallelOptimizer, build_optimizer
from .runtime.peak_memory import PeakMemory, peak_memory
from .runtime.pipeline import infer_step, train_step
from .runtime.parallel_attributes import (get_parallel_dim, register_ddp_parameters_to_ignore,
                                          register_parallel_attribute, register_parallel_dim, slice)
from .runtime.reducer import Reducer
from .runtime.state_dict import collect_state_dict, gather_optimizer_state, gather_state_dict, relocate_state_dict
from .runtime.unit_inputs import UnitInputMismatchError
from .runtime.ddp import DDPWrapError
from .why_not import why_not
from .runtime.eager_guard import EagerCallError, EagerCallOnShardsError, RecompileLimitError, summon_full_params
from . import checkpoint  # noqa: F401  (dynshard.checkpoint.save / load / latest)
from .checkpoint.merged import (broadcast_weights, deduped_state_dict, load_deduped_state_dict,
                                load_merged_state_dicts, merge_state_dicts)

route_torch_clip_grad_norm()     # torch.nn.utils.clip_grad_norm_ on dynshard's parameters: the global norm
keep_floats_constant()           # sizes go symbolic under dynamic=True, not the model's numbers


def data_parallel_rank(plan_ngpus: int = 1) -> tuple[int, int]:
    """(dp rank, dp size) for a sampler: ranks of one plan unit must read the same batch. Before the
    process group exists (dynshard makes it at the first compiled call), torchrun's RANK and WORLD_SIZE."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank // plan_ngpus, world // plan_ngpus


__all__ = ["broadcast_weights", "deduped_state_dict", "load_deduped_state_dict", "load_merged_state_dicts",
           "merge_state_dicts", "Config", "ConfigError", "Explanation", "GradScaler", "Layout", "ParallelOptimizer", "PlanBuilder",
           "PeakMemory", "peak_memory", "Plan", "PlanError", "PlanFileError", "PlanMismatchError", "plan", "planner", "Planning", "PlannerError", "why_not", "Profile", "profile", "PlanningFailedError", "Reducer", "build_optimizer", "clip_grad_norm_",
           "collect_state_dict", "gather_optimizer_state", "gather_state_dict",
           "data_parallel_rank", "explain", "get_parallel_dim", "infer_step", "no_sync", "register_ddp_parameters_to_ignore",
           "register_parallel_attribute", "register_parallel_dim", "relocate_state_dict", "slice", "summon_full_params", "tensor_parallel",
           "train_step", "BackendFailedError", "DDPWrapError", "EagerCallError", "EagerCallOnShardsError",
           "RecompileLimitError", "SymbolicShapesError", "UnitInputMismatchError"]
