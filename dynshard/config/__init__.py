"""dynshard's configuration: one frozen, validated dataclass.

The fields follow nnScaler's ComputeConfig where they apply to a compiler backend. Every field can also
be given by an environment variable ``DYNSHARD_<FIELD>`` (``DYNSHARD_PLAN_NGPUS=2``); options passed to
``torch.compile(..., options=...)`` win over the environment.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from types import MappingProxyType
from typing import Any, Callable, Mapping, Union

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from .autodist import AutodistOptions
from .errors import ConfigError
from .pins import check_pins, read_pins
from .pipeline import PipelineOptions

POLICIES = ("dp", "data", "tp", "pp", "hybrid", "autodist")
PIPELINE_POLICIES = ("pp", "hybrid")
COMPILERS = ("inductor", "aot_eager")
COMPILE_SCOPES = ("program", "blocks")
TRACE_STRATEGIES = ("fake", "meta")
ENV_PREFIX = "DYNSHARD_"

Policy = Union[str, Callable[..., Any]]
ParamInitFn = Callable[["torch.nn.Module"], None]


@dataclasses.dataclass(frozen=True)
class Config:
    """How dynshard parallelises a compiled model.

    plan_ngpus: ranks in one plan unit; the model is partitioned (tensor parallel, batch split) inside a
        unit, and units are data-parallel replicas of each other.
    runtime_ngpus: ranks at run time (defaults to the world size); a multiple of plan_ngpus.
    policy: "dp", "data", "tp", "pp" (pipeline stages inside a unit, see :mod:`dynshard.runtime.pipeline`),
        "hybrid" (pipeline stages, each split Megatron's way over plan_ngpus / stages ranks), "autodist"
        (the plan a cost model predicts fastest under ``pas_config["mem_constraint"]``, see
        :mod:`dynshard.autodist`), a callable ``policy(plan, config)`` that places parameters
        through :class:`dynshard.policies.PlanBuilder`, or a planner (``dynshard.planner(fn)``, see
        :mod:`dynshard.config.planner`) that returns the whole Plan: mesh, pipeline, ZeRO, recompute.
    pas_config: options for the policy (read by the policy itself).
    user_config: anything that changes the traced program; part of the plan-cache key.
    inference_only: programs run without autograd (no gradients, no gradient collectives).
    use_end2end: nnScaler's end-to-end module: the model takes a sample and returns the loss (a scalar)
        first; ``dynshard.train_step`` / ``infer_step`` drive it. Required by the pipeline policies.
    constant_folding: bake the values of buffers into inference programs (Inductor freezing).
    gather_outputs: True: every tensor a program returns is whole (gathered inside the plan unit). False:
        a returned tensor that is split inside the unit (vocab-parallel logits, sequence-parallel hidden
        states, head-split KV caches) leaves as a DTensor over the unit's ranks, not gathered; the loss
        and other whole values stay plain tensors. ``.full_tensor()`` (on every rank) gathers one.
    trace_strategy: "fake" plans with FakeTensors on the model's device, "meta" on the meta device.
    compiler: "inductor" (C++ on CPU, Triton on GPU) or "aot_eager" (no code generation, for debugging).
    regional_compile: compile a block that repeats (``blocks.0``, ``blocks.1``, ... of one class, traced
        alike) once and call it for every repetition, so that compile time does not grow with depth
        (see :mod:`dynshard.passes.outline_repeated_blocks` for when it applies). False: one unrolled program.
    compile_scope: what Inductor generates code for. "program": the whole program. "blocks": only the
        blocks regional_compile outlined; the program around them (embedding, head, loss) runs as its
        traced ATen ops (torch's regional-compilation recipe, and FSDP2 + torch.compile's scope: a
        faster first step, the top level unfused). A program with no outlined block is compiled whole;
        so is the weight-gradient half of a split (zero-bubble) backward. No effect with aot_eager.
    cache_dir: where plans are stored so that a restart skips planning; None keeps them in memory only.
    save_plan_path: rank 0 writes the job's plans (:class:`dynshard.Plan`) to this file as they are made: one
        plan per graph Dynamo captures, in compile order (see :mod:`dynshard.planning.files`). Not part of the plan.
    load_plan_path: run the plans in this file (saved by a job, made offline by ``dynshard.plan``, edited by
        hand) instead of running a policy: rank 0 reads it and sends it to the others. The plan's mesh, ZeRO,
        recompute, mixed precision and pipeline replace this config's ``plan_ngpus``, ``policy``,
        ``pas_config``, ``use_zero``/``zero_*``, ``recompute_modules`` and ``mixed_precision``. A graph no plan
        in the file was made for raises :class:`dynshard.PlanFileError` on every rank, naming the first mismatch.
    share_traces: whether the ranks of a host that hold the same program trace it once, the others
        waiting to read it from aot_autograd's cache (Inductor's code is generated once per host either
        way). None: where the host's ranks outnumber its cores, where a waiting rank's core is worth
        less than the tracing it saves (with as many cores as ranks, the ranks trace side by side).
        Not part of the plan: it changes who compiles, not what.
    trace_dir: pipeline policies: each rank writes a Chrome trace of its steps there
        (``dynshard_trace_rank<r>.json``: forward, backward, send and receive waits; Perfetto opens it).
    verify_inputs_every: the ranks of a plan unit must be fed the same batch; they compare a digest of
        every user input on the first call of each program and then every N-th call, and raise on every
        rank where they differ (a sampler over the whole world instead of
        ``dynshard.data_parallel_rank(plan_ngpus)``). 0: never. In the plan key (ranks must agree on it).
    broadcast_buffers: DDP's semantics for buffers a program writes (BatchNorm's running statistics):
        after the call that wrote them, every data-parallel replica takes the first replica's values, so
        evaluation and checkpoints do not depend on the rank. False: each replica keeps its own.

    Memory (nnScaler's names; see docs/design.md for what each level holds and sends):
    use_zero: 0 (or False) replicates parameters over the data-parallel units; 1 (or True), 2 and 3 shard
        every trainable parameter's rows over them (ZeRO-1: all-reduce then slice the gradient, or
        reduce-scatter with zero_use_reduce_scatter; ZeRO-2: reduce-scatter; ZeRO-3: also free the
        gathered parameter after the forward and gather it again in the backward).
    zero_ngroups: split the data-parallel ranks into this many contiguous groups; parameters are sharded
        inside a group and replicated across groups (HSDP).
    zero_use_reduce_scatter: at level 1, reduce-scatter gradients instead of all-reducing and slicing.
    use_async_reducer: overlap gradient reduction with the backward (in-graph buckets, reordered).
    reducer_bucket_cap_mb: bucket size for gradient reductions; None or 0: Inductor's default (one bucket)
        in the graph, 25 MB (async) or one bucket (sync) for reductions outside it.
    mixed_precision: torch's ``MixedPrecisionPolicy`` (or a dict of its fields): compute in param_dtype,
        reduce gradients in reduce_dtype; parameters, gradients and optimizer state stay in their dtype.
    recompute_modules: comma-separated module class names or module paths whose activations are
        recomputed in the backward instead of kept ("ROOT": the whole program).
    partition_constraints: pins, ``{"<parameter or module pattern>": "replicate" or "S<dim>"}``: those
        tensors take that placement on the tp ranks whatever the policy chooses (see
        :mod:`dynshard.config.pins`; autodist's ``pas_config['partition_constraints_path']`` names a file).

    Models built on the meta device (``with torch.device("meta"): model = GPT(cfg)``; see
    :mod:`dynshard.runtime.materialize`):
    param_init_fn: ``param_init_fn(module)`` initializes the parameters and buffers ``module`` owns
        directly (not its children's), in place. On the first step each rank calls it for every module of
        the model that owns meta tensors, in ``model.modules()`` order, and keeps only its shards. None:
        each such module's ``reset_parameters()``. Every rank must seed its RNG the same. Also a
        ``"module:function"`` import path (the form ``DYNSHARD_PARAM_INIT_FN`` takes). Part of the plan key
        by its qualified name.
    """

    plan_ngpus: int = 1
    runtime_ngpus: int | None = None
    policy: Policy = "dp"
    pas_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    user_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inference_only: bool = False
    use_end2end: bool = False
    constant_folding: bool = False
    gather_outputs: bool = True
    trace_strategy: str = "fake"
    compiler: str = "inductor"
    regional_compile: bool = True
    compile_scope: str = "program"
    cache_dir: str | None = None
    save_plan_path: str | None = None
    load_plan_path: str | None = None
    share_traces: bool | None = None
    trace_dir: str | None = None
    verify_inputs_every: int = 100
    broadcast_buffers: bool = True
    use_zero: int = 0
    zero_ngroups: int = 1
    zero_use_reduce_scatter: bool = False
    use_async_reducer: bool = False
    reducer_bucket_cap_mb: float | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    recompute_modules: str = ""
    param_init_fn: ParamInitFn | None = None
    partition_constraints: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("pas_config", "user_config"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ConfigError(f"dynshard: {name} must be a dict, got {type(value).__name__}")
            object.__setattr__(self, name, MappingProxyType(dict(value)))
        _check_int("plan_ngpus", self.plan_ngpus)
        every = self.verify_inputs_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ConfigError(f"dynshard: verify_inputs_every must be an integer >= 0 (0: never), got {every!r}")
        for name in ("save_plan_path", "load_plan_path"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, os.PathLike)):
                raise ConfigError(f"dynshard: {name} must be a file path, got {getattr(self, name)!r}")
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)) or None)
        if self.share_traces not in (None, True, False):
            raise ConfigError(f"dynshard: share_traces must be True, False or None (decided per host), "
                              f"got {self.share_traces!r}")
        if self.runtime_ngpus is not None:
            _check_int("runtime_ngpus", self.runtime_ngpus)
            if self.runtime_ngpus % self.plan_ngpus:
                raise ConfigError(
                    f"dynshard: runtime_ngpus={self.runtime_ngpus} is not a multiple of "
                    f"plan_ngpus={self.plan_ngpus}; every data-parallel unit needs plan_ngpus ranks")
        if isinstance(self.policy, str):
            if self.policy not in POLICIES:
                raise ConfigError(
                    f"dynshard: unknown policy {self.policy!r}; use one of {', '.join(POLICIES)} "
                    "or a callable policy(plan, config)")
            if self.policy == "dp" and self.plan_ngpus != 1 and self.load_plan_path is None:
                raise ConfigError(
                    f"dynshard: policy 'dp' needs plan_ngpus=1 (got {self.plan_ngpus}); "
                    "use 'tp' or 'data' to partition inside a unit")
        elif not callable(self.policy):
            raise ConfigError(f"dynshard: policy must be a name or a callable, got {self.policy!r}")
        if self.compiler not in COMPILERS:
            raise ConfigError(
                f"dynshard: unknown compiler {self.compiler!r}; use one of {', '.join(COMPILERS)}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(
                f"dynshard: unknown compile_scope {self.compile_scope!r}; use one of {', '.join(COMPILE_SCOPES)}")
        if self.compile_scope == "blocks" and not self.regional_compile:
            raise ConfigError(
                "dynshard: compile_scope='blocks' compiles the blocks regional_compile outlines; it needs "
                "regional_compile=True")
        if self.trace_strategy not in TRACE_STRATEGIES:
            raise ConfigError(
                f"dynshard: unknown trace_strategy {self.trace_strategy!r}; use one of "
                f"{', '.join(TRACE_STRATEGIES)} (dynshard traces with Dynamo and FakeTensors, never runs "
                "the model to plan it)")
        if self.constant_folding and not self.inference_only:
            raise ConfigError(
                "dynshard: constant_folding=True bakes buffer values into the program and needs "
                "inference_only=True")
        object.__setattr__(self, "partition_constraints", check_pins(self.partition_constraints))
        self._check_memory_fields()
        self._check_pipeline_fields()
        self._check_autodist_fields()
        object.__setattr__(self, "param_init_fn", _param_init_fn(self.param_init_fn))

    def _check_memory_fields(self) -> None:
        zero = self.use_zero
        if isinstance(zero, bool):
            zero = int(zero)
            object.__setattr__(self, "use_zero", zero)
        if not isinstance(zero, int) or zero not in (0, 1, 2, 3):
            raise ConfigError(f"dynshard: use_zero must be 0/False, 1/True, 2 or 3, got {self.use_zero!r}")
        _check_int("zero_ngroups", self.zero_ngroups)
        if self.zero_ngroups != 1 and not zero:
            raise ConfigError(
                f"dynshard: zero_ngroups={self.zero_ngroups} only applies with use_zero >= 1; set use_zero "
                "or leave zero_ngroups at 1")
        if self.zero_use_reduce_scatter and not zero:
            raise ConfigError("dynshard: zero_use_reduce_scatter=True only applies with use_zero >= 1")
        if self.zero_use_reduce_scatter and self.zero_ngroups != 1:
            raise ConfigError(
                f"dynshard: zero_use_reduce_scatter=True needs zero_ngroups=1 (got {self.zero_ngroups}), as "
                "in nnScaler; use use_zero=2 for reduce-scattered gradients with groups")
        for name in ("zero_use_reduce_scatter", "use_async_reducer", "gather_outputs", "regional_compile",
                     "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dynshard: {name} must be True or False, got {getattr(self, name)!r}")
        cap = self.reducer_bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0):
            raise ConfigError(f"dynshard: reducer_bucket_cap_mb must be None or a number >= 0, got {cap!r}")
        object.__setattr__(self, "mixed_precision", mixed_precision_policy(self.mixed_precision))
        if not isinstance(self.recompute_modules, str):
            raise ConfigError(
                "dynshard: recompute_modules is a comma-separated string of module class names or paths, "
                f"got {self.recompute_modules!r}")
        object.__setattr__(self, "recompute_modules",
                           ",".join(n.strip() for n in self.recompute_modules.split(",") if n.strip()))

    def _check_pipeline_fields(self) -> None:
        if not isinstance(self.use_end2end, bool):
            raise ConfigError(f"dynshard: use_end2end must be True or False, got {self.use_end2end!r}")
        if not self.is_pipeline:
            return
        options = PipelineOptions.from_pas_config(self.pas_config)
        options.check(self)

    def _check_autodist_fields(self) -> None:
        if self.policy != "autodist":
            return
        options = AutodistOptions.from_pas_config(self.pas_config)
        options.check(self)
        for name in ("load_plan_path", "save_plan_path"):     # nnScaler's keys for the plan files
            if getattr(options, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(options, name)))
        if options.partition_constraints_path is not None:
            pins = read_pins(options.partition_constraints_path)
            if self.partition_constraints and dict(self.partition_constraints) != dict(pins):
                raise ConfigError("dynshard: partition_constraints and pas_config['partition_constraints_path'] "
                                  "differ; set one")
            object.__setattr__(self, "partition_constraints", pins)

    @functools.cached_property      # (pas_config is a read-only copy: the options cannot go stale)
    def autodist(self) -> AutodistOptions:
        """``policy="autodist"``'s typed ``pas_config`` (:class:`dynshard.config.autodist.AutodistOptions`)."""
        return AutodistOptions.from_pas_config(self.pas_config)

    @property
    def is_pipeline(self) -> bool:
        """Whether the policy cuts the model into pipeline stages."""
        return isinstance(self.policy, str) and self.policy in PIPELINE_POLICIES

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline ranks in a plan unit (1 without a pipeline policy)."""
        return self.pipeline.pipeline_ranks(self) if self.is_pipeline else 1

    @functools.cached_property
    def pipeline(self):
        """The pipeline policies' typed ``pas_config`` (:class:`dynshard.config.pipeline.PipelineOptions`)."""
        return PipelineOptions.from_pas_config(self.pas_config)

    @property
    def zero(self) -> int:
        """The ZeRO level (0 when parameters are replicated over the data-parallel units)."""
        return self.use_zero

    @property
    def recompute_names(self) -> tuple[str, ...]:
        return tuple(self.recompute_modules.split(",")) if self.recompute_modules else ()

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: "Config | Mapping[str, Any] | None",
                     environ: Mapping[str, str] | None = None) -> "Config":
        """Build a Config from torch.compile's ``options`` and ``DYNSHARD_*`` environment variables."""
        environ = os.environ if environ is None else environ
        explicit: dict[str, Any]
        if options is None:
            explicit = {}
        elif isinstance(options, Config):
            explicit = {f: getattr(options, f) for f in cls.fields()}
            explicit = {k: v for k, v in explicit.items() if _is_set(options, k)}
        elif isinstance(options, Mapping):
            unknown = sorted(set(options) - set(cls.fields()))
            if unknown:
                raise ConfigError(
                    f"dynshard: unknown option(s) {', '.join(map(repr, unknown))}; "
                    f"valid options are {', '.join(cls.fields())}")
            explicit = dict(options)
        else:
            raise ConfigError(
                f"dynshard: options must be a dynshard.Config or a dict, got {type(options).__name__}")
        from_env = _read_environment(environ)
        return cls(**{**from_env, **explicit})

    def resolve(self, world_size: int, plan_fields: bool = True) -> "Config":
        """Fill runtime_ngpus from the world size and check that the world fits the plan (``plan_fields``
        False: a given plan decides the factorisation and ZeRO groups, and was checked against the world)."""
        runtime = self.runtime_ngpus if self.runtime_ngpus is not None else world_size
        if runtime != world_size:
            raise ConfigError(
                f"dynshard: runtime_ngpus={runtime} but the job has {world_size} ranks; launch with "
                f"torchrun --nproc-per-node {runtime} or set runtime_ngpus={world_size}")
        if not plan_fields:
            return dataclasses.replace(self, runtime_ngpus=runtime)
        if world_size % self.plan_ngpus:
            raise ConfigError(
                f"dynshard: plan_ngpus={self.plan_ngpus} does not divide the world size {world_size}")
        dp_size = world_size // self.plan_ngpus
        if self.zero_ngroups > 1 and dp_size % self.zero_ngroups:
            raise ConfigError(
                f"dynshard: zero_ngroups={self.zero_ngroups} does not divide the {dp_size} data-parallel "
                f"units (world {world_size} / plan_ngpus {self.plan_ngpus}); choose a divisor of {dp_size}")
        return dataclasses.replace(self, runtime_ngpus=runtime)

    def cache_token(self) -> str:
        """The part of the plan-cache key that comes from the configuration."""
        parts = {f: getattr(self, f) for f in self.fields()
                 if f not in ("cache_dir", "trace_dir", "share_traces", "policy", "param_init_fn",
                              "save_plan_path", "load_plan_path")}
        parts["policy"] = self.policy if isinstance(self.policy, str) else _qualified_name(self.policy)
        parts["param_init_fn"] = None if self.param_init_fn is None else _qualified_name(self.param_init_fn)
        parts["pas_config"] = dict(self.pas_config)
        parts["user_config"] = dict(self.user_config)
        parts["partition_constraints"] = dict(self.partition_constraints)
        return json.dumps(parts, sort_keys=True, default=repr)

    def describe(self) -> str:
        rows = []
        for f in self.fields():
            value = getattr(self, f)
            if isinstance(value, MappingProxyType):
                value = dict(value)
            rows.append(f"{f}={value!r}")
        return "dynshard.Config(" + ", ".join(rows) + ")"


def _qualified_name(fn: Callable[..., Any]) -> str:
    """A callable by name (the same on every rank and across restarts, unlike its repr); a policy object
    whose plan depends on its contents says so with a ``cache_token()`` method."""
    if hasattr(fn, "cache_token"):
        return fn.cache_token()
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def _param_init_fn(value: Any) -> ParamInitFn | None:
    """The callable itself, or the one a ``"module:function"`` (or ``"module.function"``) path names."""
    if value is None or (callable(value) and not isinstance(value, str)):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"dynshard: param_init_fn must be a callable param_init_fn(module) or a 'module:function' path, "
            f"got {value!r}")
    module_name, sep, attr = value.strip().partition(":")
    if not sep:
        module_name, _, attr = value.strip().rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if module_name and attr else None
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"dynshard: cannot import param_init_fn {value!r}: {error}") from None
    if not callable(fn):
        raise ConfigError(f"dynshard: param_init_fn {value!r} does not name a callable (use 'module:function')")
    return fn


def _check_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"dynshard: {name} must be a positive integer, got {value!r}")


def _is_set(config: Config, name: str) -> bool:
    """A field of an explicit Config counts as given unless it still has its default value."""
    field = next(f for f in dataclasses.fields(Config) if f.name == name)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return getattr(config, name) != default


def _read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    hints = {f.name: f for f in dataclasses.fields(Config)}
    known = {ENV_PREFIX + name.upper(): name for name in hints}
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if key not in known:
            raise ConfigError(
                f"dynshard: unknown environment variable {key}; valid ones are {', '.join(sorted(known))}")
        name = known[key]
        values[name] = _parse_env(name, raw, key)
    return values


_INTS = ("plan_ngpus", "runtime_ngpus", "zero_ngroups", "verify_inputs_every")
_BOOLS = ("inference_only", "use_end2end", "constant_folding", "gather_outputs", "zero_use_reduce_scatter", "use_async_reducer",
          "regional_compile", "broadcast_buffers")
_JSON = ("pas_config", "user_config", "mixed_precision", "partition_constraints")


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _parse_env(name: str, raw: str, key: str) -> Any:
    try:
        if name in _INTS:
            return int(raw)
        if name in _BOOLS:
            return _parse_bool(raw)
        if name == "use_zero":
            return int(raw) if raw.strip().isdigit() else _parse_bool(raw)
        if name == "share_traces":
            return None if raw.strip().lower() in ("", "none", "auto") else _parse_bool(raw)
        if name == "reducer_bucket_cap_mb":
            return None if raw.strip().lower() in ("", "none") else float(raw)
        if name in _JSON:
            parsed = json.loads(raw)
            if not isinstance(parsed, dict):
                raise ValueError(raw)
            return parsed
    except ValueError:
        raise ConfigError(f"dynshard: cannot read {key}={raw!r} as the type of Config.{name}") from None
    return raw


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(f"dynshard: mixed_precision {name} must be a floating dtype such as "
                          f"'bfloat16', got {value!r}")
    return dtype


def mixed_precision_policy(value: Any) -> MixedPrecisionPolicy | None:
    """torch's MixedPrecisionPolicy from itself, a dict of its fields (dtypes by name), or None."""
    if value is None:
        return None
    if isinstance(value, MixedPrecisionPolicy):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, Mapping):
        raise ConfigError("dynshard: mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy "
                          f"or a dict of its fields, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"dynshard: unknown mixed_precision field(s) {', '.join(map(repr, unknown))}; "
                          f"valid fields are {', '.join(sorted(known))}")
    fields = {k: (v if k == "cast_forward_inputs" else _dtype(k, v)) for k, v in value.items()}
    return MixedPrecisionPolicy(**fields)
