"""dynshard's configuration: one frozen, validated dataclass.

The fields follow nnScaler's ComputeConfig where they apply to a compiler backend. Every field can also
be given by an environment variable ``DYNSHARD_<FIELD>`` (``DYNSHARD_PLAN_NGPUS=2``); options passed to
``torch.compile(..., options=...)`` win over the environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Any, Callable, Mapping, Union

POLICIES = ("dp", "data", "tp")
COMPILERS = ("inductor", "aot_eager")
TRACE_STRATEGIES = ("fake", "meta")
ENV_PREFIX = "DYNSHARD_"

Policy = Union[str, Callable[..., Any]]


class ConfigError(ValueError):
    """The configuration cannot work; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Config:
    """How dynshard parallelises a compiled model.

    plan_ngpus: ranks in one plan unit; the model is partitioned (tensor parallel, batch split) inside a
        unit, and units are data-parallel replicas of each other.
    runtime_ngpus: ranks at run time (defaults to the world size); a multiple of plan_ngpus.
    policy: "dp", "data", "tp", or a callable ``policy(plan, config)`` that places parameters through
        :class:`dynshard.policies.PlanBuilder`.
    pas_config: options for the policy (read by the policy itself).
    user_config: anything that changes the traced program; part of the plan-cache key.
    inference_only: programs run without autograd (no gradients, no gradient collectives).
    constant_folding: bake the values of buffers into inference programs (Inductor freezing).
    trace_strategy: "fake" plans with FakeTensors on the model's device, "meta" on the meta device.
    compiler: "inductor" (C++ on CPU, Triton on GPU) or "aot_eager" (no code generation, for debugging).
    cache_dir: where plans are stored so that a restart skips planning; None keeps them in memory only.
    """

    plan_ngpus: int = 1
    runtime_ngpus: int | None = None
    policy: Policy = "dp"
    pas_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    user_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inference_only: bool = False
    constant_folding: bool = False
    trace_strategy: str = "fake"
    compiler: str = "inductor"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("pas_config", "user_config"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ConfigError(f"dynshard: {name} must be a dict, got {type(value).__name__}")
            object.__setattr__(self, name, MappingProxyType(dict(value)))
        _check_int("plan_ngpus", self.plan_ngpus)
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
            if self.policy == "dp" and self.plan_ngpus != 1:
                raise ConfigError(
                    f"dynshard: policy 'dp' needs plan_ngpus=1 (got {self.plan_ngpus}); "
                    "use 'tp' or 'data' to partition inside a unit")
        elif not callable(self.policy):
            raise ConfigError(f"dynshard: policy must be a name or a callable, got {self.policy!r}")
        if self.compiler not in COMPILERS:
            raise ConfigError(
                f"dynshard: unknown compiler {self.compiler!r}; use one of {', '.join(COMPILERS)}")
        if self.trace_strategy not in TRACE_STRATEGIES:
            raise ConfigError(
                f"dynshard: unknown trace_strategy {self.trace_strategy!r}; use one of "
                f"{', '.join(TRACE_STRATEGIES)} (dynshard traces with Dynamo and FakeTensors, never runs "
                "the model to plan it)")
        if self.constant_folding and not self.inference_only:
            raise ConfigError(
                "dynshard: constant_folding=True bakes buffer values into the program and needs "
                "inference_only=True")

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

    def resolve(self, world_size: int) -> "Config":
        """Fill runtime_ngpus from the world size and check that the world fits the plan."""
        runtime = self.runtime_ngpus if self.runtime_ngpus is not None else world_size
        if runtime != world_size:
            raise ConfigError(
                f"dynshard: runtime_ngpus={runtime} but the job has {world_size} ranks; launch with "
                f"torchrun --nproc-per-node {runtime} or set runtime_ngpus={world_size}")
        if world_size % self.plan_ngpus:
            raise ConfigError(
                f"dynshard: plan_ngpus={self.plan_ngpus} does not divide the world size {world_size}")
        return dataclasses.replace(self, runtime_ngpus=runtime)

    def cache_token(self) -> str:
        """The part of the plan-cache key that comes from the configuration."""
        policy = self.policy if isinstance(self.policy, str) else (
            f"{getattr(self.policy, '__module__', '')}.{getattr(self.policy, '__qualname__', repr(self.policy))}")
        parts = {f: getattr(self, f) for f in self.fields() if f not in ("cache_dir", "policy")}
        parts["policy"] = policy
        parts["pas_config"] = dict(self.pas_config)
        parts["user_config"] = dict(self.user_config)
        return json.dumps(parts, sort_keys=True, default=repr)

    def describe(self) -> str:
        rows = []
        for f in self.fields():
            value = getattr(self, f)
            if isinstance(value, MappingProxyType):
                value = dict(value)
            rows.append(f"{f}={value!r}")
        return "dynshard.Config(" + ", ".join(rows) + ")"


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


def _parse_env(name: str, raw: str, key: str) -> Any:
    try:
        if name in ("plan_ngpus", "runtime_ngpus"):
            return int(raw)
        if name in ("inference_only", "constant_folding"):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if name in ("pas_config", "user_config"):
            parsed = json.loads(raw)
            if not isinstance(parsed, dict):
                raise ValueError(raw)
            return parsed
    except ValueError:
        raise ConfigError(f"dynshard: cannot read {key}={raw!r} as the type of Config.{name}") from None
    return raw
