"""``policy="autodist"``'s options: nnScaler's ``pas_config`` keys, typed and validated.

autodist searches the plans dynshard executes for the one its cost model predicts fastest under a memory
budget (:mod:`dynshard.autodist`). Every key nnScaler's autodist reads is accepted; the ones this
version of the search cannot honour yet raise a :class:`ConfigError` that says so, rather than being
ignored.

mem_constraint: GB per device a plan may use at its peak (parameters, gradients, optimizer state,
    activations, transient); None: no limit.
update_freq: micro-batches per optimizer step (gradient accumulation; ``no_sync`` micro-steps).
use_fp16 / use_bf16: checked against ``Config.mixed_precision`` (set the precision there; autodist prices
    what the program runs).
load_plan_path / save_plan_path: mapped onto ``Config.load_plan_path`` / ``save_plan_path``.
recompute_modules: comma-separated module class names or paths always recomputed (no search over it).
max_partition_degree: the most ranks a tensor is split over inside a unit (default: plan_ngpus). Below
    plan_ngpus only pipelines whose stages split over at most that many ranks qualify (``explore_pipeline``).
transient_mem_coef: the peak's transient term, as nnScaler: this many times the largest tensor an op
    writes (default 2).
device_profile: a calibration file (``python -m dynshard.calibrate``), or "cpu" / "cuda" for the built-in
    constants (planning offline for GPUs on a CPU machine); None: the built-in constants of the device the
    graph's tensors are on.
verbose: log every candidate's predicted cost (``TORCH_LOGS=+dynshard`` logs them at debug anyway).
task_name: a label carried into the plan's predictions.
re_profile / parallel_profile: nnScaler re-times operators on the device; dynshard's profile is computed
    on FakeTensors each time (nothing is cached or timed), so both are accepted and change nothing.
explore_pipeline: also price pipelines (policy "pp": every rank of a unit one stage) with the schedules
    of ``pipeline_scheduler`` (default: 1f1b, gpipe, zb1p, 1f1b_interleaved with two stages per pipeline
    rank where ``update_freq`` allows it, and chimera_direct, at ZeRO 0, where a unit of 4 ranks is 4 stages and
    ``update_freq`` is even; not 1f1b_plus), ``update_freq`` micro-batches, stages cut
    before ``pipeline_pivots`` (module classes; default: the repeated layers). Needs ``use_end2end=True``
    and ``dynshard.train_step``. ZeRO levels are searched for pipelines too (uniform), and so is every
    factorisation of ``plan_ngpus`` into pp stages of tp ranks (the hybrid policy's pipelines).
partition_constraints_path: a JSON file of pins (``Config.partition_constraints``, :mod:`.pins`): every
    candidate the search prices holds them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .errors import ConfigError, check_option_names

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zb1p", "1f1b_interleaved", "chimera_direct")     # what autodist prices
INTERLEAVED_CHUNKS = 2      # stages per rank of the 1f1b_interleaved candidates


@dataclasses.dataclass(frozen=True)
class AutodistOptions:
    mem_constraint: float | None = None
    update_freq: int = 1
    use_fp16: bool = False
    use_bf16: bool = False
    load_plan_path: str | None = None
    save_plan_path: str | None = None
    partition_constraints_path: str | None = None
    recompute_modules: str | None = None
    pipeline_pivots: str = ""
    explore_pipeline: bool = False
    pipeline_scheduler: str | None = None
    max_partition_degree: int | None = None
    transient_mem_coef: float = 2.0
    device_profile: str | None = None
    re_profile: bool = False
    verbose: bool = False
    task_name: str = ""
    parallel_profile: bool = True

    @classmethod
    def from_pas_config(cls, pas_config: Mapping[str, Any]) -> "AutodistOptions":
        check_option_names(cls, pas_config, "policy 'autodist'")
        options = cls(**pas_config)
        options._check_types()
        options._check_not_built()
        return options

    def _check_types(self) -> None:
        if self.mem_constraint is not None and (isinstance(self.mem_constraint, bool) or not isinstance(
                self.mem_constraint, (int, float)) or self.mem_constraint <= 0):
            raise ConfigError(f"dynshard: pas_config['mem_constraint'] is GB per device, a positive number; "
                              f"got {self.mem_constraint!r}")
        for name in ("update_freq",) + (("max_partition_degree",) if self.max_partition_degree is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"dynshard: pas_config[{name!r}] must be a positive integer, got {value!r}")
        for name in ("use_fp16", "use_bf16", "explore_pipeline", "re_profile", "verbose", "parallel_profile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dynshard: pas_config[{name!r}] must be True or False, got {getattr(self, name)!r}")
        if self.use_fp16 and self.use_bf16:
            raise ConfigError("dynshard: pas_config sets both use_fp16 and use_bf16; choose one")
        coef = self.transient_mem_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ConfigError(f"dynshard: pas_config['transient_mem_coef'] must be a number >= 0, got {coef!r}")
        for name in ("load_plan_path", "save_plan_path", "device_profile", "partition_constraints_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"dynshard: pas_config[{name!r}] must be a file path, got {value!r}")
        if self.recompute_modules is not None and not isinstance(self.recompute_modules, str):
            raise ConfigError("dynshard: pas_config['recompute_modules'] is a comma-separated string of module "
                              f"class names or paths, got {self.recompute_modules!r}")
        if not isinstance(self.task_name, str):
            raise ConfigError(f"dynshard: pas_config['task_name'] must be a string, got {self.task_name!r}")

    def _check_not_built(self) -> None:
        if self.pipeline_scheduler is not None and self.pipeline_scheduler not in PIPELINE_SCHEDULES:
            raise ConfigError(f"dynshard: autodist searches the pipeline schedules {', '.join(PIPELINE_SCHEDULES)}; "
                              f"pas_config['pipeline_scheduler']={self.pipeline_scheduler!r} is not one of them")
        if not isinstance(self.pipeline_pivots, str):
            raise ConfigError("dynshard: pas_config['pipeline_pivots'] is a comma-separated string of module "
                              f"class names, got {self.pipeline_pivots!r}")

    @property
    def schedules(self) -> tuple[str, ...]:
        """The pipeline schedules the search tries (the one named, or every one it prices)."""
        return (self.pipeline_scheduler,) if self.pipeline_scheduler is not None else PIPELINE_SCHEDULES

    def check(self, config) -> None:
        """Against the rest of the configuration: precision, plan files, pipelines."""
        limit = self.max_partition_degree
        if limit is not None and limit < config.plan_ngpus and not self.explore_pipeline:
            raise ConfigError(
                f"dynshard: pas_config['max_partition_degree']={limit} is below plan_ngpus={config.plan_ngpus}: every "
                "placement without a pipeline splits tensors over the whole unit. Set explore_pipeline=True (pipelines "
                f"of stages split over at most {limit} ranks), or plan_ngpus to at most {limit}")
        if self.explore_pipeline and not config.use_end2end:
            raise ConfigError("dynshard: pas_config['explore_pipeline'] needs use_end2end=True (a pipeline runs an "
                              "end-to-end module: forward takes the sample and returns the loss first), and the "
                              "training loop calls dynshard.train_step(model, samples) with update_freq samples")
        if self.pipeline_scheduler == "chimera_direct" and (config.plan_ngpus != 4 or self.update_freq % 2):
            raise ConfigError(
                "dynshard: pas_config['pipeline_scheduler']='chimera_direct' runs 4 pipeline ranks (each stage on "
                "two of them; autodist does not put tp inside its stages yet) and sends micro-batches in pairs: "
                f"plan_ngpus must be 4 and update_freq even; got plan_ngpus={config.plan_ngpus}, "
                f"update_freq={self.update_freq}. Use another schedule, or none (every one autodist prices)")
        mp = config.mixed_precision
        compute = None if mp is None else mp.param_dtype
        for flag, name in ((self.use_bf16, "bfloat16"), (self.use_fp16, "float16")):
            if flag and (compute is None or str(compute) != f"torch.{name}"):
                raise ConfigError(
                    f"dynshard: pas_config asks autodist for {name} (use_{'bf16' if name == 'bfloat16' else 'fp16'}) "
                    f"but the program computes in {compute or 'the parameters dtype'}; set mixed_precision="
                    f"{{'param_dtype': torch.{name}}} (autodist prices what the program runs)")
        for name in ("load_plan_path", "save_plan_path"):
            mine, theirs = getattr(self, name), getattr(config, name)
            if mine is not None and theirs is not None and os.fspath(mine) != theirs:
                raise ConfigError(f"dynshard: pas_config[{name!r}]={os.fspath(mine)!r} and Config.{name}={theirs!r} "
                                  "differ; set one")

    @property
    def mem_constraint_bytes(self) -> int | None:
        return None if self.mem_constraint is None else int(self.mem_constraint * 1024 ** 3)
