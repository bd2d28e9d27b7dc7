"""The error every configuration check raises, and the check every typed ``pas_config`` starts with."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class ConfigError(ValueError):
    """The configuration cannot work; the message says what to change."""


class SymbolicShapesError(TypeError):
    """A symbolic graph under a plan that compiles static shapes only, or at sizes its plan cannot split."""


def check_option_names(options: type, pas_config: Mapping[str, Any], owner: str) -> None:
    """Raise ConfigError naming every key of ``pas_config`` that the dataclass ``options`` has no field for."""
    fields = [f.name for f in dataclasses.fields(options)]
    unknown = sorted(set(pas_config) - set(fields))
    if unknown:
        raise ConfigError(f"dynshard: {owner} has no option {', '.join(map(repr, unknown))} in pas_config; it "
                          f"takes {', '.join(fields)}")
