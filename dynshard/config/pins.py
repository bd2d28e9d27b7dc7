"""``Config.partition_constraints``: parameters and modules pinned to a placement on the tp ranks, whatever
the policy (or autodist's search) would choose. nnScaler's ``partition_constraints_path`` (autodist's
``pas_config``) names a file of them.

The pins map a pattern to a placement::

    {"lm_head.weight": "replicate",          # a parameter or buffer, by its fully qualified name
     "layers.*.mlp": "replicate",            # a module path: every parameter and buffer under it
     "layers.*.attn.q_proj.weight": "S0"}    # split along dim 0 over the tp ranks ("S1": dim 1)

Patterns are shell-style (``fnmatch``: ``*`` matches across dots); the first pattern that matches a tensor
(in the mapping's order) pins it. A pinned tensor is fixed for the policy: Megatron's ``tp`` leaves the
pair it belongs to alone, and propagation places the activations around it. The file is JSON: that mapping,
or ``{"pins": {...}}``. nnScaler's own YAML constraints are per operator (``allowed_partition_dims``); dynshard
plans per tensor, so it reads this form only.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ConfigError

_SPLIT = re.compile(r"S(\d+)")


def check_pins(pins: Any, source: str = "partition_constraints") -> Mapping[str, str]:
    """The pins as placement codes ("R", "S<d>"), read-only; ConfigError naming the first bad entry."""
    if not isinstance(pins, Mapping):
        raise ConfigError(f"dynshard: {source} maps parameter or module patterns to 'replicate' or 'S<dim>', "
                          f"got {type(pins).__name__}")
    checked = {}
    for pattern, placement in pins.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"dynshard: {source} has a pattern {pattern!r}; patterns are non-empty strings")
        code = "R" if placement in ("replicate", "R") else placement
        if not isinstance(code, str) or not (code == "R" or _SPLIT.fullmatch(code)):
            raise ConfigError(f"dynshard: {source}[{pattern!r}] is {placement!r}; pin 'replicate' or 'S<dim>' "
                              "(split along that dim over the tp ranks), e.g. 'S0'")
        checked[pattern] = code
    return MappingProxyType(checked)


def read_pins(path: str | os.PathLike) -> Mapping[str, str]:
    """The pins of a partition constraints file (JSON)."""
    where = f"the partition constraints file {os.fspath(path)!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as error:
        raise ConfigError(f"dynshard: cannot read {where}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"dynshard: {where} is not JSON ({error}); write {{\"pins\": {{\"<pattern>\": "
                          "\"replicate\" or \"S<dim>\"}}") from None
    if isinstance(data, list):
        raise ConfigError(f"dynshard: {where} looks like nnScaler's per-operator constraints (a list); dynshard "
                          "pins tensors: write {\"pins\": {\"<parameter or module pattern>\": \"replicate\" or "
                          "\"S<dim>\"}}")
    return check_pins(data.get("pins", data) if isinstance(data, dict) else data, where)


def pin_of(name: str, pins: Mapping[str, str]) -> tuple[str, str] | None:
    """(pattern, placement code) of the first pin that covers the tensor ``name``, or None."""
    for pattern, code in pins.items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
            return pattern, code
    return None


def split_dim(code: str) -> int | None:
    match = _SPLIT.fullmatch(code)
    return int(match[1]) if match else None
