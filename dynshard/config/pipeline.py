"""The pipeline policies' options: ``pas_config`` keys with nnScaler's names, typed and validated.

``policy="pp"`` cuts the captured graph into ``pipeline_nstages`` stages (:mod:`dynshard.passes.cut_stages`)
run by the ranks of a plan unit (``plan_ngpus`` ranks, ``pipeline_nchunks`` stages each, loop
placement); units are data-parallel replicas, as with every other policy. ``policy="hybrid"`` gives
each pipeline rank ``plan_ngpus / (pipeline_nstages / pipeline_nchunks)`` ranks that split its stages as
``policy="tp"`` does (nnScaler's hybrid: stages x tensor parallel).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .errors import ConfigError, check_option_names

TRAINING_SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved", "1f1b_plus", "chimera_direct", "zb1p")
INFERENCE_SCHEDULES = ("infer_pipe",)


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """``pas_config`` of ``policy="pp"`` (methods take the :class:`dynshard.Config` it belongs to).

    pipeline_nmicros: micro-batches per step (required); ``train_step`` takes exactly this many samples,
        a plain call splits its batch into this many along dim 0.
    pipeline_nstages: stages in all (pp default: plan_ngpus x pipeline_nchunks; required by hybrid).
    pipeline_scheduler: gpipe, 1f1b (default), 1f1b_interleaved, 1f1b_plus (1F1B over the stages after
        a first segment run tensor-parallel on every rank of the unit), chimera_direct, zb1p (zero bubble),
        or infer_pipe (inference_only).
    pipeline_nchunks: stages each rank runs (the interleaved schedule); stage s runs on rank s % plan_ngpus.
    pipeline_pivots: comma-separated module class names a stage may start at (cut before an instance).
    """

    pipeline_nmicros: int = 0
    pipeline_nstages: int | None = None
    pipeline_scheduler: str = "1f1b"
    pipeline_nchunks: int = 1
    pipeline_pivots: str = ""
    sequence_parallel: bool = False      # hybrid: the tp policy's sequence parallelism inside each stage

    @classmethod
    def from_pas_config(cls, pas_config: Mapping[str, Any]) -> "PipelineOptions":
        check_option_names(cls, pas_config, "the pipeline policies' pas_config")
        if "pipeline_nmicros" not in pas_config:
            raise ConfigError("dynshard: pipeline policies need pas_config['pipeline_nmicros'], the number of "
                              "micro-batches per step (e.g. {'pipeline_nmicros': 8})")
        options = cls(**pas_config)
        for name in ("pipeline_nmicros", "pipeline_nchunks") + (
                ("pipeline_nstages",) if options.pipeline_nstages is not None else ()):
            value = getattr(options, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"dynshard: pas_config[{name!r}] must be a positive integer, got {value!r}")
        if not isinstance(options.pipeline_pivots, str):
            raise ConfigError("dynshard: pas_config['pipeline_pivots'] is a comma-separated string of module "
                              f"class names, got {options.pipeline_pivots!r}")
        return options

    @property
    def pivots(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.pipeline_pivots.split(",") if n.strip())

    def pipeline_ranks(self, config) -> int:
        """Pipeline ranks in a unit: every rank under pp; stages / chunks under hybrid."""
        return config.plan_ngpus if config.policy == "pp" else self.nstages(config) // self.pipeline_nchunks

    def nstages(self, config) -> int:
        """Pipeline stages (not counting 1f1b_plus's all-device segment)."""
        return self.pipeline_nstages if self.pipeline_nstages is not None else config.plan_ngpus * self.pipeline_nchunks

    def check(self, config) -> None:
        """nnScaler's rules, and what dynshard does not build yet, as errors that say what to change."""
        name = self.pipeline_scheduler
        if name not in TRAINING_SCHEDULES + INFERENCE_SCHEDULES:
            raise ConfigError(f"dynshard: unknown pipeline_scheduler {name!r}; use one of "
                              f"{', '.join(TRAINING_SCHEDULES + INFERENCE_SCHEDULES)}")
        if config.inference_only and name not in INFERENCE_SCHEDULES:
            raise ConfigError(f"dynshard: pipeline_scheduler {name!r} trains; with inference_only=True use "
                              "'infer_pipe'")
        if not config.inference_only and name in INFERENCE_SCHEDULES:
            raise ConfigError(f"dynshard: pipeline_scheduler {name!r} runs forward only; set inference_only=True "
                              f"or use a training schedule ({', '.join(TRAINING_SCHEDULES)})")
        if not config.use_end2end:
            raise ConfigError(f"dynshard: policy {config.policy!r} needs use_end2end=True (nnScaler's end-to-end module: "
                              "forward takes the sample and returns the loss first)")
        if config.policy == "hybrid":
            self._check_hybrid(config)
        elif self.sequence_parallel:
            raise ConfigError("dynshard: sequence_parallel splits stages over tp ranks: use policy 'hybrid'")
        nstages = self.nstages(config)
        if config.policy == "pp" and nstages != config.plan_ngpus * self.pipeline_nchunks:
            raise ConfigError(
                f"dynshard: pipeline_nstages={nstages} does not fit plan_ngpus={config.plan_ngpus} x "
                f"pipeline_nchunks={self.pipeline_nchunks} (policy 'pp' runs pipeline_nchunks stages on each "
                f"rank of a unit); set pipeline_nstages={config.plan_ngpus * self.pipeline_nchunks} or change "
                "plan_ngpus / pipeline_nchunks")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"dynshard: pas_config['sequence_parallel'] must be True or False, "
                              f"got {self.sequence_parallel!r}")
        broken = broken_schedule_rule(name, nstages, self.pipeline_nmicros, self.pipeline_nchunks, config.use_zero)
        if broken is not None:
            raise ConfigError(f"dynshard: {broken}")

    def _check_hybrid(self, config) -> None:
        if self.pipeline_nstages is None:
            raise ConfigError("dynshard: policy 'hybrid' needs pas_config['pipeline_nstages'] (plan_ngpus = stages / "
                              "pipeline_nchunks x tensor-parallel ranks per stage)")
        if self.pipeline_nstages % self.pipeline_nchunks:
            raise ConfigError(f"dynshard: pipeline_nstages={self.pipeline_nstages} is not a multiple of "
                              f"pipeline_nchunks={self.pipeline_nchunks}")
        ranks = self.pipeline_nstages // self.pipeline_nchunks
        if config.plan_ngpus % ranks:
            raise ConfigError(f"dynshard: policy 'hybrid' runs {ranks} pipeline ranks (pipeline_nstages / "
                              f"pipeline_nchunks), which does not divide plan_ngpus={config.plan_ngpus}; use a "
                              f"multiple of {ranks}")


def broken_schedule_rule(schedule: str, nstages: int, nmicros: int, nchunks: int, zero_level: int) -> str | None:
    """The rule of ``schedule`` these counts break, said with ``pas_config``'s keys (None: none); a
    configuration and a plan file are held to the same rules."""
    if schedule == "chimera_direct" and (nstages != 4 or nmicros % 2):
        return (f"chimera_direct runs exactly 4 stages (each on two ranks, in two directions) and sends micro-batches "
                f"down and up in pairs; got pipeline_nstages={nstages}, pipeline_nmicros={nmicros}. Use 4 stages and "
                "an even pipeline_nmicros, or another schedule")
    if nchunks > 1 and schedule != "1f1b_interleaved":
        return (f"pipeline_nchunks={nchunks} needs pipeline_scheduler '1f1b_interleaved' ({schedule!r} runs one stage "
                "per rank)")
    if schedule == "1f1b_plus" and zero_level:
        return ("use_zero with pipeline_scheduler '1f1b_plus' is not built yet (its all-device segment is tensor "
                "parallel over the unit); use '1f1b' with use_zero")
    return None
