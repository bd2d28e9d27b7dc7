"""What DTensor answered for an op, kept by what the op was given, so that a transformer's repeated layers
(and a policy's repeated trials) ask DTensor once per distinct op rather than once per node.

Sharding propagation runs every ATen node on fake DTensors; two nodes that run the same overload on inputs
of the same spec (mesh, placements, global shape and stride, and the local tensor's own layout) and the
same non-tensor arguments get the same answer: the same redistributions and an output of the same spec. A
32-layer GPT has ~2700 nodes but ~90 distinct ops, and the tp policy propagates it a dozen times.

An entry keeps the fake output of the first node that asked. Reusing that object for a later node is
sound for propagation, which reads placements and metadata only; ops that mutate an argument are not
kept (their output is the argument itself), nor are ops given plain tensors (their values are not
described by a spec), nor outputs whose placement holds state of its own (a vocabulary-parallel
embedding's ``MaskPartial`` keeps its mask until the reduction uses it up), nor values of symbolic sizes
(a SymInt does not hash; a symbolic program's propagation runs once, on a plan already made).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Partial

from .. import compat
from ..compat import FakeMode, pytree

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclasses.dataclass
class OpMemo:
    """Answers by key (:func:`op_key`), for the propagations run under one fake mode."""

    fake_mode: FakeMode
    answers: dict = dataclasses.field(default_factory=dict)

    def keep(self, key, redistributions, out) -> None:
        if key is not None and stateless(out):
            self.answers[key] = (redistributions, out)

    def input(self, mesh, meta: tuple, placements: tuple, make) -> DTensor:
        """A graph input of ``meta`` (shape, stride, dtype, device, requires_grad) at ``placements``: one
        value per distinct input (a transformer's layers have the same parameters many times)."""
        key = ("input", mesh, tuple(meta), placements)
        if _symbolic(meta[0]):      # (a SymInt does not hash: every symbolic input is its own)
            return make(meta, placements)
        if key not in self.answers:
            self.answers[key] = make(meta, placements)
        return self.answers[key]

    def redistribute(self, value: DTensor, mesh, placements) -> DTensor:
        """``value.redistribute(mesh, placements)``, once per spec."""
        spec = value_key(value) if stateless(value) else None
        key = None if spec is None else ("redistribute", spec, tuple(placements))
        if key in self.answers:
            return self.answers[key]
        out = value.redistribute(mesh, placements)
        if key is not None:
            self.answers[key] = out
        return out

    def for_mode(self, fake_mode: FakeMode) -> "OpMemo":
        """This memo, or a new one when ``fake_mode`` is another (fake values do not cross modes)."""
        return self if fake_mode is self.fake_mode else OpMemo(fake_mode)


def op_key(target, args: tuple, kwargs: dict):
    """What decides DTensor's answer for ``target(*args, **kwargs)``; None when it cannot be kept."""
    if target._schema.is_mutable:
        return None
    try:
        return target, _key(args), _key(tuple(sorted(kwargs.items())))
    except _Unkeyable:
        return None


def value_key(value):
    """``value`` as a hashable description of everything propagation reads from it; None when it holds
    something a spec does not describe (a plain tensor)."""
    try:
        return _key(value)
    except _Unkeyable:
        return None


def stateless(out) -> bool:
    """Whether every placement of ``out`` is described by its spec (a ``MaskPartial`` holds a mask)."""
    return all(type(p) is Partial or not isinstance(p, Partial)
               for leaf in pytree.tree_leaves(out) if isinstance(leaf, DTensor) for p in leaf.placements)


class _Unkeyable(Exception):
    pass


def _symbolic(shape) -> bool:
    return any(isinstance(size, torch.SymInt) for size in shape)


def _key(value):
    if isinstance(value, DTensor):
        spec = compat.dtensor_spec(value)
        if _symbolic(spec.shape) or _symbolic(spec.stride):
            raise _Unkeyable      # (a program on symbolic sizes asks DTensor for every node)
        return compat.dtensor_spec(value), compat.local_layout(value)
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((k, _key(v)) for k, v in value.items())
    if isinstance(value, _SCALARS):
        return type(value), value       # (1, 1.0 and True hash alike but give different dtypes)
    raise _Unkeyable
