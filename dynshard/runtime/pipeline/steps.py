"""nnScaler's ``train_step`` / ``infer_step`` for a model compiled with dynshard.

    losses = dynshard.train_step(model, samples)     # one optimizer step's micro-batches
    opt.step(); opt.zero_grad()

Under a pipeline policy the whole schedule runs inside the call; under any other policy the samples
run one after another with the data-parallel reduction only after the last (``no_sync`` before it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from ... import compat
from ...config import Config
from ...config.planner import Planner
from ..accumulation import no_sync
from .ownership import reduce_gradients
from .recorder import recording


def _config_of(model: torch.nn.Module) -> Config | None:
    options = compat.module_backend_options(model)
    if compat.module_backend(model) is None:
        return None
    return Config.from_options(options)


def _loss_of(output: Any) -> torch.Tensor:
    """The loss of an end-to-end module's output: the output itself, or its first element or value."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "values"):
        return next(iter(output.values()))
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(f"dynshard.train_step: the model returned {type(output).__name__}; an end-to-end module "
                    "returns the loss first (a tensor, a tuple/list starting with it, or a dict)")


def _check(samples: Sequence[Any], is_dummy_batch, config: Config | None) -> list[bool]:
    if is_dummy_batch is not None and len(is_dummy_batch) != len(samples):
        raise ValueError(f"dynshard: is_dummy_batch has {len(is_dummy_batch)} entries for {len(samples)} samples")
    if _runs_pipeline(config) and len(samples) != config.pipeline.pipeline_nmicros:
        raise ValueError(f"dynshard: train_step/infer_step got {len(samples)} samples but the pipeline runs "
                         f"pipeline_nmicros={config.pipeline.pipeline_nmicros} micro-batches per step; pass "
                         "exactly that many (pad with dummy samples flagged in is_dummy_batch)")
    return list(is_dummy_batch) if is_dummy_batch is not None else [False] * len(samples)


def _recorded_program(recorder, samples):
    plans = {id(call.program.plan) for call in recorder.calls}
    if len(recorder.calls) != len(samples) or len(plans) != 1:
        raise RuntimeError(
            f"dynshard: under a pipeline policy the model must compile into one graph per call, the same for "
            f"every sample; {len(samples)} samples gave {len(recorder.calls)} pipelined call(s) of {len(plans)} "
            "plan(s). Remove graph breaks (TORCH_LOGS=graph_breaks shows them) and give every sample the same shapes")
    return recorder.calls[0].program


def _fill(program, run, recorder, schedule) -> None:
    """Write each micro-batch's outputs (from the rank of its last stage) into what the calls returned."""
    plan = program.plan
    tensors, sources = [], []
    for mb, call in enumerate(recorder.calls):
        source = program.last_stage_rank(schedule, mb)
        for position, (ref, out) in enumerate(zip(plan.staged.outputs, call.outputs)):
            if ref[0] != "value":
                continue
            if mb in run.outputs:
                out.copy_(run.outputs[mb][position].detach())
            tensors.append(out)
            sources.append(source)
    program.broadcast(tensors, sources)


def train_step(model: torch.nn.Module, samples: Sequence[Any], is_dummy_batch: Sequence[bool] | None = None,
               scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Any]:
    """One training step over ``samples`` (micro-batches), with nnScaler's semantics: gradients are zeroed
    first; the gradient is the sum over micro-batches of d scale_fn(loss_i) (loss_i without scale_fn); a
    dummy micro-batch runs but contributes nothing; the model's outputs (loss first) are returned, detached,
    on every rank. The model is an end-to-end module: ``model(sample)`` returns the loss first."""
    samples = list(samples)
    config = _config_of(model)
    dummy = _check(samples, is_dummy_batch, config)
    model.zero_grad(set_to_none=True)

    def scaled(loss: torch.Tensor, mb: int) -> torch.Tensor:
        loss = scale_fn(loss) if scale_fn is not None else loss
        return loss * 0.0 if dummy[mb] else loss

    first, pipeline = None, _runs_pipeline(config)
    if config is not None and _plan_decides(config):
        # an automatic policy chooses a pipeline or not when the graph compiles, in this first call: a
        # pipeline program only records it; any other runs it, as the loop below would have
        with torch.enable_grad(), recording() as recorder, (
                no_sync(model) if len(samples) > 1 else contextlib.nullcontext()):
            first = model(samples[0])
            if not recorder.calls:
                scaled(_loss_of(first), 0).backward()
        if recorder.calls:
            with torch.enable_grad(), recording() as rest:
                returned = [first] + [model(sample) for sample in samples[1:]]
            recorder.calls.extend(rest.calls)
            return _run_pipeline(recorder, returned, samples, scaled)
    if not pipeline:
        outputs = [] if first is None else [_detach(first)]
        for mb, sample in enumerate(samples[len(outputs):], start=len(outputs)):
            last = mb == len(samples) - 1
            with contextlib.nullcontext() if last else no_sync(model):
                output = model(sample)
                scaled(_loss_of(output), mb).backward()
            outputs.append(_detach(output))
        return outputs

    with torch.enable_grad(), recording() as recorder:
        returned = [model(sample) for sample in samples]
    return _run_pipeline(recorder, returned, samples, scaled)


def _plan_decides(config: Config) -> bool:
    """Whether the plan, made or read when the graph compiles, decides if the model runs as a pipeline."""
    return (config.load_plan_path is not None or (config.policy == "autodist" and config.autodist.explore_pipeline)
            or isinstance(config.policy, Planner))


def _runs_pipeline(config: Config | None) -> bool:
    """Whether the model is known to run as a pipeline before it compiles: a pipeline policy's outline."""
    return config is not None and not _plan_decides(config) and config.is_pipeline


def _run_pipeline(recorder, returned: list, samples: list, scaled) -> list[Any]:
    program = _recorded_program(recorder, samples)
    if len(samples) != program.plan.nmicros:
        raise ValueError(f"dynshard: train_step got {len(samples)} samples but the pipeline runs "
                         f"{program.plan.nmicros} micro-batches per step; pass exactly that many")
    plan = program.plan
    loss_position = _loss_position(recorder.calls[0], returned[0])

    def seed(mb: int, outputs: list[Any]):
        loss = scaled(outputs[loss_position], mb)
        return [loss], [torch.ones_like(loss)]

    run = program.run(plan.schedule, [call.args for call in recorder.calls], train=True, seed_fn=seed)
    reduce_gradients(plan.ownership, plan.groups)
    _fill(program, run, recorder, plan.schedule)
    plan.finish_step(run)
    return returned


def infer_step(model: torch.nn.Module, samples: Sequence[Any]) -> list[Any]:
    """Forward only over ``samples`` (the infer_pipe order under a pipeline policy); the model's outputs
    per sample, on every rank."""
    samples = list(samples)
    config = _config_of(model)
    _check(samples, None, config)
    if config is None or not (_runs_pipeline(config) or _plan_decides(config)):
        with torch.no_grad():
            return [model(sample) for sample in samples]
    with torch.no_grad(), recording() as recorder:
        returned = [model(sample) for sample in samples]
    if not recorder.calls:          # the plan is not a pipeline's: each sample has run
        return returned
    program = _recorded_program(recorder, samples)
    run = program.run(program.plan.forward_only, [call.args for call in recorder.calls], train=False)
    _fill(program, run, recorder, program.plan.forward_only)
    program.plan.finish_step(run)
    return returned


def _loss_position(call, returned: Any) -> int:
    loss = _loss_of(returned)
    for position, out in enumerate(call.outputs):
        if out is loss:
            return position
    raise RuntimeError("dynshard: the loss the model returned is not an output of its compiled graph (computed "
                       "after a graph break?); compute the loss inside the model's forward")


def _detach(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, (tuple, list)):
        return type(output)(_detach(o) for o in output)
    if isinstance(output, dict):
        return {k: _detach(v) for k, v in output.items()}
    return output
