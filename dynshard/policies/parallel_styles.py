"""The placements a style of ``torch.distributed.tensor.parallel`` asks for, read from its attributes
into a :class:`StyleSpec` (the policy :func:`~.tensor_parallel.tensor_parallel` places them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard

from .plan_builder import PlanError


@dataclasses.dataclass(frozen=True)
class StyleSpec:
    """One style of the plan, normalised (torch's style objects are not kept: their ``_apply`` mutates
    them). Layout tuples hold Placements or None ("leave this one")."""

    style: str                       # torch's class name
    input_layouts: tuple | None = None
    desired_input_layouts: tuple | None = None
    input_kwarg_layouts: tuple = ()          # ((name, placement), ...)
    desired_input_kwarg_layouts: tuple = ()
    output_layouts: tuple | None = None
    desired_output_layouts: tuple | None = None
    sequence_dim: int | None = None
    use_local_output: bool | None = None     # accepted, ignored (see the module docstring)
    use_local_input: bool | None = None

    def token(self) -> dict:
        out: dict[str, Any] = {"style": self.style}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("style", "use_local_output", "use_local_input") and value not in (None, ()):
                out[field.name] = _describe(value)
        return out


def _describe(value):
    if isinstance(value, tuple):
        return [_describe(v) for v in value]
    if isinstance(value, Placement):
        return repr(value)
    return value


_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput")


def _layouts(value) -> tuple | None:
    if value is None:
        return None
    return (value,) if isinstance(value, Placement) else tuple(value)


def style_spec(style: Any) -> StyleSpec:
    """The placements a torch ParallelStyle asks for, read from its attributes."""
    from torch.distributed.tensor.parallel import style as tp_style

    name = type(style).__name__
    if name not in _STYLES or type(style) is not getattr(tp_style, name):
        base = next((s for s in _STYLES if isinstance(style, getattr(tp_style, s))), None)
        why = (f"a subclass of {base}, which may not mean what {base} means (dynshard maps each style by "
               f"its meaning, it does not run its hooks)" if base else "not a style dynshard knows")
        raise PlanError(f"dynshard: tensor_parallel plan value {style!r} is {why}; use one of "
                        f"{', '.join(_STYLES)} from torch.distributed.tensor.parallel")
    if name == "PrepareModuleInputOutput":
        inp, out = style_spec(style.prepare_module_input), style_spec(style.prepare_module_output)
        spec = dataclasses.replace(inp, style=name, output_layouts=out.output_layouts,
                                   desired_output_layouts=out.desired_output_layouts,
                                   use_local_input=inp.use_local_output, use_local_output=out.use_local_output)
    elif name == "SequenceParallel":
        spec = StyleSpec(name, sequence_dim=style.sequence_sharding[0].dim, use_local_output=style.use_local_output)
    elif name == "PrepareModuleInput":
        spec = StyleSpec(name, input_layouts=_layouts(style.input_layouts),
                         desired_input_layouts=_layouts(style.desired_input_layouts),
                         input_kwarg_layouts=tuple(style.input_kwarg_layouts.items()),
                         desired_input_kwarg_layouts=tuple(style.desired_input_kwarg_layouts.items()),
                         use_local_output=style.use_local_output)
    elif name == "PrepareModuleOutput":
        spec = StyleSpec(name, output_layouts=_layouts(style.output_layouts),
                         desired_output_layouts=_layouts(style.desired_output_layouts),
                         use_local_output=style.use_local_output)
    else:   # Colwise, Rowwise: the desired input depends on the module (Linear or Embedding)
        spec = StyleSpec(name, input_layouts=_layouts(style.input_layouts),
                         output_layouts=_layouts(style.output_layouts), use_local_output=style.use_local_output)
    for layouts in (spec.desired_input_layouts, spec.desired_output_layouts, spec.output_layouts
                    if name in ("ColwiseParallel", "RowwiseParallel") else None):
        for placement in layouts or ():
            if placement is not None and not isinstance(placement, (Replicate, Shard)):
                raise PlanError(f"dynshard: {style!r} asks for {placement}; a value can only be placed "
                                "Replicate() or Shard(dim)")
    for _, placement in spec.desired_input_kwarg_layouts:
        if placement is not None and not isinstance(placement, (Replicate, Shard)):
            raise PlanError(f"dynshard: {style!r} asks for {placement}; a value can only be placed "
                            "Replicate() or Shard(dim)")
    return spec
