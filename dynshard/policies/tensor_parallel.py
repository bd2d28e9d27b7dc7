"""``tensor_parallel(plan)``: a declarative policy from torch's tensor-parallel styles.

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    policy = dynshard.tensor_parallel({
        "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel(),
    })
    model = torch.compile(model, backend="dynshard", options=dynshard.Config(policy=policy, plan_ngpus=2))

The plan is the one written for ``parallelize_module``: keys are module paths from the compiled module,
where ``*`` (and the other shell wildcards) match inside one path component (``layers.*.attention.wq``),
values are the styles of ``torch.distributed.tensor.parallel``. Every style becomes placements through
the ordinary policy API (:class:`~.plan_builder.PlanBuilder`): parameters with ``shard``/``replicate``,
values entering and leaving modules with ``place_activation``. Placements the plan does not set are
propagated by DTensor, as with any policy.

What each style places ("input" is the value a module reads, "output" the value it returns):

==========================  ==================================  =====================  =====================
style                       parameters                          input (desired)        output
==========================  ==================================  =====================  =====================
ColwiseParallel on Linear   weight Shard(0), bias Shard(0)      Replicate              output_layouts,
                                                                                       default Shard(-1)
ColwiseParallel on Embed.   weight Shard(1)                     Replicate              same
RowwiseParallel on Linear   weight Shard(1), bias Replicate     Shard(-1)              output_layouts, default
                                                                                       Replicate: all-reduce;
                                                                                       Shard(d): reduce-scatter
RowwiseParallel on Embed.   weight Shard(0) (vocab parallel)    Replicate              same
SequenceParallel            every parameter Replicate           Shard(sequence_dim)    Shard(sequence_dim)
PrepareModuleInput          --                                  desired_input_layouts  --
                                                                (and kwarg layouts)
PrepareModuleOutput         --                                  --                     desired_output_layouts
PrepareModuleInputOutput    --                                  both                   both
==========================  ==================================  =====================  =====================

A placed value is redistributed where it is produced (:meth:`~.plan_builder.PlanBuilder.place_activation`).
An output is placed for every reader, as torch's output hook changes what the module returns; the output
of a row-split Linear is placed where its partial sum is produced (before its bias), so
``output_layouts=Shard(1)`` is a reduce-scatter, not an all-reduce and a slice. An input is placed for
the module's own reads only, as torch's input hook redistributes what that module sees: a norm's output
gathered for q, k and v is still a sequence shard for a residual add that reads it; the readers of every
module asking the same placement share one collective. When styles ask different placements of one
value, the reader's desired input wins over the writer's output (SequenceParallel's norm output Shard(1),
then the ColwiseParallel projection that reads it: one all-gather), a deeper module over an enclosing
one, and of two plan entries on one module the later (its hook runs last); anything else is an error.
A placement that propagation already gives is not placed, so a plan that asks for what DTensor does
anyway prints as the automatic ``tp`` policy's (the Megatron plan, with or without sequence parallelism,
gives exactly ``tp``'s placements and collectives on the test GPT).

How modules are found in the ATen graph. Lowering keeps each op's ``nn_module_stack`` (Dynamo records it,
and ``make_fx`` under ``preserve_node_meta`` copies it to every ATen node the op decomposes to, as
:mod:`..passes.tag_recompute` relies on too). Its entries are keyed by module *call* (``id@k`` for the
k-th call of one module), so each call of a module is a set of nodes (ops that a pass added without
metadata, such as the blocks of a fused projection, belong where their first input does): its input is
the first value it reads that was produced outside the call (not a parameter, buffer or a cast/view/block
of one), its outputs the values it produces that are read outside the call; every call of a module is
placed. Parameters are found by fully qualified
name (``path.weight``), and by use: a parameter that the module reads but that is registered under
another name (an LM head tied to the embedding: one graph input, ``wte.weight``) is its weight (2-D) or
bias (1-D).

What is ignored, and why:
- ``use_local_output`` (and ``use_local_input``): dynshard keeps global semantics. The user's code always
  sees global shapes and values (the program is traced once on whole tensors); there is no local tensor
  that a module could return instead of a DTensor, so this flag cannot change the math, only torch's
  eager bookkeeping.
- ``input_layouts`` and PrepareModuleOutput's ``output_layouts``: in torch they *annotate* a local tensor
  (how the previous module left it). In dynshard how a value arrives is known exactly (propagated from
  its producer, or placed by another style); it is never reinterpreted. Only the desired layout places
  the value; the collective is whatever moves it from where it actually is. (A None entry still means
  "leave this input alone".)
- ``src_data_rank``: parameters are split from the values every rank holds.
Limits: positional and keyword inputs of PrepareModuleInput are told apart by the order in which the
module first reads them (the graph does not keep argument names): layouts are matched to the values
when their number is the number of values entering the module (or of the non-None layouts); otherwise
the policy raises and says so. Several outputs (PrepareModuleOutput) are in the order they are produced.
A module that returns a value it did not compute (its input, unchanged) has no output node of its own.
A graph input (an argument of the compiled model) that a style places is split where it enters the
program, for all its readers (it arrives whole on every rank of the unit).
Colwise and Rowwise take ``nn.Linear`` and ``nn.Embedding`` (and subclasses), as torch does; subclasses of
the styles (Float8 styles, custom ones) are refused, since they may mean something else. A pattern must
match a module of each compiled graph; with graph breaks, ``strict=False`` skips the others' patterns.
Parameters not named by the plan are replicated (the default of every policy), as ``parallelize_module``
leaves them; activations between styled modules are placed by DTensor's propagation.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard

from ..config import Config
from ..passes.op_sets import TRANSPOSE_OPS, VIEW_OPS, aten
from ..passes.propagation import Propagation
from ..passes.split_fused_projections import param_block
from ..passes.tag_recompute import module_path
from ..runtime.sharding import placements_for
from .parallel_styles import StyleSpec, style_spec
from .plan_builder import PlanBuilder, PlanError

# ops through which a module reads a parameter (a cast by mixed precision, a block of a fused weight)
_PARAMETER_VIEWS = TRANSPOSE_OPS | VIEW_OPS | {aten._to_copy.default, aten.alias.default, aten.detach.default,
                                               torch.ops.prims.convert_element_type.default}

# priorities of requests on one value: the reader's desired input, the writer's output, the partial sum
# reduced inside the writer
_INPUT, _OUTPUT, _PARTIAL = 3, 2, 1


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a module in the graph: its nodes (those of its submodules' calls included)."""

    key: str                  # the nn_module_stack key of this call
    path: str
    cls: Any                  # the module's class (or its name, where the graph only kept a string)
    depth: int                # how many modules enclose it
    nodes: tuple              # fx nodes, graph order


@dataclasses.dataclass
class _Request:
    priority: int
    depth: int
    placement: Placement
    origin: str               # "pattern (style on path) input/output", for errors
    call: str = ""            # the module call asking
    order: int = 0            # the plan entry asking: on one module, the later entry's hook runs last
    readers: tuple | None = None   # for an input: the module's nodes that read it (None: every reader)


class TensorParallelPolicy:
    """The policy :func:`tensor_parallel` returns: ``policy(plan, config)``, picklable, with no state
    that a call changes."""

    def __init__(self, plan: Mapping[str, Any], strict: bool = True):
        if not isinstance(plan, Mapping):
            raise PlanError(f"dynshard: tensor_parallel takes a dict of module path patterns to styles, got "
                            f"{type(plan).__name__}")
        entries = []
        for pattern, style in plan.items():
            if not isinstance(pattern, str) or not pattern or any(not part for part in pattern.split(".")):
                raise PlanError(f"dynshard: tensor_parallel plan key {pattern!r} is not a module path pattern "
                                "such as 'layers.*.attention.wq' (the compiled module itself has no path)")
            entries.append((pattern, style_spec(style)))
        self.entries: tuple[tuple[str, StyleSpec], ...] = tuple(entries)
        self.strict = bool(strict)

    def cache_token(self) -> str:
        """A stable description of the plan (the same on every rank and across restarts)."""
        return "dynshard.tensor_parallel:" + json.dumps(
            {"plan": [[pattern, spec.token()] for pattern, spec in self.entries], "strict": self.strict},
            sort_keys=True)

    def __repr__(self) -> str:
        items = ", ".join(f"{pattern!r}: {spec.style}" for pattern, spec in self.entries)
        return f"dynshard.tensor_parallel({{{items}}}{'' if self.strict else ', strict=False'})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorParallelPolicy) and other.cache_token() == self.cache_token()

    def __hash__(self) -> int:
        return hash(self.cache_token())

    def __call__(self, plan: PlanBuilder, config: Config) -> None:
        _Planner(plan, self.entries, self.strict).run()


def tensor_parallel(plan: Mapping[str, Any], *, strict: bool = True) -> TensorParallelPolicy:
    """A policy from a ``parallelize_module`` plan: ``{module path pattern: ParallelStyle}``.

    Use it as ``Config(policy=dynshard.tensor_parallel(plan), plan_ngpus=N)``. Styles are those of
    ``torch.distributed.tensor.parallel`` (ColwiseParallel, RowwiseParallel, SequenceParallel,
    PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput) with their keyword arguments and
    their meaning for ``nn.Linear`` and ``nn.Embedding``; see :mod:`dynshard.policies.tensor_parallel`.

    ``use_local_output`` is accepted and ignored: dynshard keeps global semantics (the model's code sees
    whole tensors of global shapes, whatever the placements), so a module has no local shard to return
    and the flag cannot change what the program computes. ``input_layouts`` annotate how a value arrives,
    which dynshard knows from the graph; the desired layouts decide.

    A pattern that matches no module of a compiled graph raises :class:`PlanError` (with ``strict=False``
    it is skipped: a model compiled as several graphs, at graph breaks, has each pattern in only some).
    """
    return TensorParallelPolicy(plan, strict=strict)


class _Planner:
    """One run of the policy on one graph: which modules the patterns name, then their parameters, then
    the activations they ask for."""

    def __init__(self, plan: PlanBuilder, entries, strict: bool):
        self.plan = plan
        self.entries = entries
        self.strict = strict
        self.nodes = list(plan.graph.nodes)
        self.stacks = _module_stacks(self.nodes)
        self.calls = _module_calls(self.nodes, self.stacks)
        self.paths = _module_paths(self.calls, plan.state)
        self.env: dict = {}
        self.params: dict[str, tuple[Placement, str]] = {}
        self.requests: dict[fx.Node, list[_Request]] = {}
        self.partials: list[tuple[Call, fx.Node, _Request]] = []   # (call, its output, request)

    # -- the whole policy -----------------------------------------------------------------------------
    def run(self) -> None:
        applied = []
        for pattern, spec in self.entries:
            matched = [path for path in self.paths if _matches(pattern, path)]
            if not matched and self.strict:
                shown = ", ".join(self.paths[:12]) + (", ..." if len(self.paths) > 12 else "")
                raise PlanError(f"dynshard: tensor_parallel plan key {pattern!r} matches no module of the "
                                f"compiled graph ('*' matches one path component); its modules are: "
                                f"{shown or 'none'}")
            for path in matched:
                calls = [c for c in self.calls if c.path == path]
                origin = f"{pattern!r} ({spec.style} on {path})"
                self.place_parameters(spec, path, calls, origin)
                applied.append((spec, calls, origin))
        self.order = {origin: i for i, (_, _, origin) in enumerate(applied)}
        if not self.plan.ctx.layout.placement_dims:
            return      # a plan unit of one rank: nothing to place
        for name, (placement, _) in self.params.items():
            if isinstance(placement, Shard):
                self.plan.shard(name, placement.dim)
            else:
                self.plan.replicate(name)
        base = self.plan.propagate()
        self.env = base.env       # values (global shapes) of nodes that passes added without metadata
        for spec, calls, origin in applied:
            for call in calls:
                self.request_activations(spec, call, origin)
        self.place_activations(base)

    # -- parameters -----------------------------------------------------------------------------------
    def place_parameters(self, spec: StyleSpec, path: str, calls: list[Call], origin: str) -> None:
        if spec.style in ("ColwiseParallel", "RowwiseParallel"):
            kind = _module_kind(calls[0].cls) if calls else None
            if kind is None:
                what = _type_name(calls[0].cls) if calls else "a module the graph never calls"
                raise PlanError(f"dynshard: {spec.style} takes nn.Linear or nn.Embedding, but {origin} is {what}")
            colwise = spec.style == "ColwiseParallel"
            for local, name in self.module_parameters(path, calls, recursive=False):
                if kind == "linear":   # weight [out, in]: colwise splits out (and the bias), rowwise in
                    placement = Shard(0) if colwise else Shard(1) if local == "weight" else Replicate()
                else:
                    placement = Shard(1 if colwise else 0)
                self.set_parameter(name, placement, origin)
        elif spec.style == "SequenceParallel":
            for _, name in self.module_parameters(path, calls, recursive=True):
                self.set_parameter(name, Replicate(), origin)

    def module_parameters(self, path: str, calls: list[Call], recursive: bool) -> list[tuple[str, str]]:
        """(local name, graph input name) of the module's parameters: by name, and parameters registered
        under another name (tied) that the module reads: 2-D is its weight, 1-D its bias."""
        found: dict[str, str] = {}
        prefix = path + "."
        for name, inp in self.plan.state.items():
            if inp.kind == "parameter" and name.startswith(prefix) and (recursive or "." not in name[len(prefix):]):
                found[name] = name[len(prefix):]
        for call in calls:
            for node in call.nodes:
                if not recursive and _innermost_path(self.stacks.get(node)) != path:
                    continue
                for arg in node.all_input_nodes:
                    inp = self.parameter_of(arg)
                    if inp is not None and inp.kind == "parameter" and inp.name not in found:
                        found[inp.name] = {2: "weight", 1: "bias"}.get(len(inp.shape), inp.name)
        return [(local, name) for name, local in found.items()]

    def parameter_of(self, node: fx.Node):
        """The parameter or buffer ``node`` reads (through casts, views, transposes, fused blocks)."""
        while node.op == "call_function" and (node.target in _PARAMETER_VIEWS or node.target is param_block) \
                and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        inp = self.plan.input_of(node)
        return inp if inp is not None and inp.is_state else None

    def set_parameter(self, name: str, placement: Placement, origin: str) -> None:
        earlier = self.params.get(name)
        if earlier is not None and earlier[0] != placement:
            raise PlanError(f"dynshard: tensor_parallel plan places {name} as {earlier[0]} by {earlier[1]} and as "
                            f"{placement} by {origin}; a parameter has one placement")
        self.params[name] = (placement, origin)

    # -- requests on activations ----------------------------------------------------------------------
    def request_activations(self, spec: StyleSpec, call: Call, origin: str) -> None:
        if spec.style in ("ColwiseParallel", "RowwiseParallel"):
            colwise = spec.style == "ColwiseParallel"
            desired = Replicate() if colwise or _module_kind(call.cls) == "embedding" else Shard(-1)
            self.request_inputs(call, (desired,), (), origin, first_only=True)
            self.request_outputs(call, spec.output_layouts, origin)
        elif spec.style == "SequenceParallel":
            sharding = Shard(spec.sequence_dim)
            self.request_inputs(call, (sharding,), (), origin, first_only=True)
            self.request_outputs(call, (sharding,), origin)
        else:   # PrepareModuleInput / Output / InputOutput
            if spec.desired_input_layouts is not None or spec.desired_input_kwarg_layouts:
                positional = spec.desired_input_layouts or ()
                if spec.input_layouts is not None:   # None in input_layouts: leave that input as it is
                    positional = tuple(None if i is None else d for i, d in zip(spec.input_layouts, positional))
                desired_kwargs = dict(spec.desired_input_kwarg_layouts)
                kwargs = tuple(None if layout is None else desired_kwargs.get(name)
                               for name, layout in spec.input_kwarg_layouts)
                self.request_inputs(call, positional, kwargs, origin, first_only=False)
            if spec.desired_output_layouts is not None:
                desired = tuple(None if o is None else d for o, d in
                                zip(spec.output_layouts or spec.desired_output_layouts, spec.desired_output_layouts))
                self.request_outputs(call, desired, origin)

    def value(self, node: fx.Node):
        """The node's value (global shape): its metadata, or its propagated value for nodes that a
        pass added without metadata (the blocks of a fused projection)."""
        value = node.meta.get("val")
        return value if value is not None else self.env.get(node)

    def is_tensor(self, node: fx.Node) -> bool:
        return isinstance(self.value(node), torch.Tensor)

    def call_inputs(self, call: Call) -> list[fx.Node]:
        """Values entering the call (produced outside it), in the order the call first reads them;
        parameters, buffers and what is computed from them alone (casts, views) are not inputs."""
        members = set(call.nodes)
        found: dict[fx.Node, None] = {}
        for node in call.nodes:
            for arg in node.all_input_nodes:
                if arg in members or arg in found or not self.is_tensor(arg):
                    continue
                if arg.op == "placeholder":
                    inp = self.plan.input_of(arg)
                    if inp is None or inp.is_state:
                        continue
                elif arg.op != "call_function" or self.parameter_of(arg) is not None:
                    continue
                found[arg] = None
        return list(found)

    def call_outputs(self, call: Call) -> list[fx.Node]:
        """Values the call produces that are read outside it, in graph order."""
        members = set(call.nodes)
        return [n for n in call.nodes if self.is_tensor(n) and any(user not in members for user in n.users)]

    def request_inputs(self, call: Call, positional: tuple, kwargs: tuple, origin: str, first_only: bool) -> None:
        inputs = self.call_inputs(call)
        if first_only:
            pairs = list(zip(inputs[:1], positional))
        else:
            layouts = tuple(positional) + tuple(kwargs)
            given = [p for p in layouts if p is not None]
            if len(layouts) == len(inputs):
                pairs = list(zip(inputs, layouts))
            elif len(given) == len(inputs):
                pairs = list(zip(inputs, given))
            elif not given:
                pairs = []
            else:
                raise PlanError(
                    f"dynshard: {origin} gives {len(layouts)} input layouts ({len(given)} not None) but "
                    f"{len(inputs)} values enter {call.path} ({', '.join(n.name for n in inputs) or 'none'}, in the "
                    "order it first reads them); the graph does not keep argument names, so layouts are matched "
                    "to these values in order when their numbers agree")
        for node, placement in pairs:
            if placement is not None:
                readers = tuple(user for user in node.users if user in call.nodes)
                self.request(node, _INPUT, call, placement, origin, "input", readers)

    def request_outputs(self, call: Call, layouts: tuple | None, origin: str) -> None:
        if not layouts:
            return
        outputs = self.call_outputs(call)
        if len(layouts) == 1:
            pairs = [(o, layouts[0]) for o in outputs]
        elif len(layouts) == len(outputs):
            pairs = list(zip(outputs, layouts))
        else:
            raise PlanError(f"dynshard: {origin} gives {len(layouts)} output layouts but {call.path} returns "
                            f"{len(outputs)} values ({', '.join(n.name for n in outputs) or 'none'})")
        for node, placement in pairs:
            if placement is not None:
                self.partials.append((call, node, self.request(node, _OUTPUT, call, placement, origin, "output")))

    def request(self, node: fx.Node, priority: int, call: Call, placement: Placement, origin: str,
                what: str, readers: tuple | None = None) -> _Request:
        request = _Request(priority, call.depth, placement, f"{origin} {what}", call.key, self.order[origin],
                           readers)
        self.requests.setdefault(node, []).append(request)
        return request

    def partial_requests(self, node: fx.Node, base: Propagation) -> list[_Request]:
        """A partial sum produced inside a call is placed as the call's output is (a reduce-scatter rather
        than an all-reduce and a slice), when it has the output's shape and flows into it."""
        if node.name not in base.reduced_partials:
            return []
        found = []
        for call, output, request in self.partials:
            if node is output or node not in call.nodes:
                continue
            value, out = self.value(node), self.value(output)
            if value is not None and out is not None and value.shape == out.shape \
                    and _reaches(node, output, set(call.nodes)):
                found.append(dataclasses.replace(request, priority=_PARTIAL))
        return found

    def place_activations(self, base: Propagation) -> None:
        """Every request is placed at once (a sequence shard may only propagate once the gather that a
        later matmul's input asks for is placed too), then the placements that change nothing are
        dropped: those where propagation recorded no communication and no local split at the node (the
        value already had the asked placement), and partial sums asked whole. The plan must propagate the
        same without them."""
        placed: dict[fx.Node, tuple[Placement, tuple | None]] = {}
        for node in self.nodes:
            requests = self.requests.get(node, []) + self.partial_requests(node, base)
            if not requests:
                continue
            placement, readers = self.resolve(node, requests)
            inp = self.plan.input_of(node)
            if inp is not None:      # a user input: it arrives whole and is split where it enters the program
                if self.plan.placement(inp.name) != placement:
                    self.check_divides(node, placement, requests)
                    self.plan.shard(inp.name, placement.dim) if isinstance(placement, Shard) else \
                        self.plan.replicate(inp.name)
                continue
            if tuple(base.placements.get(node.name, ())) != placements_for(self.plan.ctx.layout, {"tp": placement}):
                self.check_divides(node, placement, requests)
            placed[node] = (placement, readers)
            self.plan.place_activation(node, placement, readers=readers)
        if not placed:
            return
        try:
            full = self.plan.propagate()
        except Exception as error:  # noqa: BLE001 - DTensor cannot trace this plan: say so
            raise PlanError(f"dynshard: the tensor_parallel plan cannot be propagated: {type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}") from error
        acted = {c.node for c in full.collectives} | {r.node for r in full.local_reshards if r.source == r.node}
        # a partial sum asked whole by every reader is what dynshard's rule does anyway (reduce where produced)
        unchanged = [node for node, (placement, readers) in placed.items() if node.name not in acted or (
            node.name in base.reduced_partials and placement == Replicate() and readers is None)]
        if self.same_without(full, [(node, placed[node]) for node in unchanged]):
            return
        for node in unchanged:      # rare: the changes interact; keep only those that change nothing alone
            self.same_without(full, [(node, placed[node])])

    def same_without(self, full: Propagation, removed: list) -> bool:
        """Whether the plan propagates as ``full`` with ``removed`` [(node, (placement, readers))] dropped;
        if not, they are placed again."""
        for node, _ in removed:
            self.plan.place_activation(node, None)
        try:
            same = _same_plan(self.plan.propagate(reuse=full), full)
        except Exception:  # noqa: BLE001 - not the same plan
            same = False
        if not same:
            for node, (placement, readers) in removed:
                self.plan.place_activation(node, placement, readers=readers)
        return same

    def resolve(self, node: fx.Node, requests: list[_Request]) -> tuple[Placement, tuple | None]:
        """(placement, readers: None for every reader). The request of the highest priority wins (a
        reader's input over a writer's output), then that of the deepest module, and on one module the
        last entry of the plan (its hook runs last in torch); different placements asked by different
        modules at that level are an error. An input is placed for the readers of every module that asks
        for that placement (a residual add reading a norm's output keeps the sequence shard)."""
        value = self.value(node)
        ndim = value.dim() if isinstance(value, torch.Tensor) else 0

        def normal(r: _Request) -> Placement:
            if isinstance(r.placement, Shard):
                if not -ndim <= r.placement.dim < ndim:
                    raise PlanError(f"dynshard: {r.origin} asks for {r.placement} of {node.name}, which has "
                                    f"{ndim} dimensions")
                return Shard(r.placement.dim % ndim)
            return r.placement

        top = max((r.priority, r.depth) for r in requests)
        level = [r for r in requests if (r.priority, r.depth) == top]
        last = {r.call: max(q.order for q in level if q.call == r.call) for r in level}
        chosen: dict[Placement, str] = {}
        for r in level:
            if r.order == last[r.call]:
                chosen.setdefault(normal(r), r.origin)
        if len(chosen) > 1:
            raise PlanError(f"dynshard: the tensor_parallel plan asks for {node.name} as " + " and as ".join(
                f"{p} by {origin}" for p, origin in chosen.items()) + "; one value has one placement")
        placement = next(iter(chosen))
        same = [r for r in requests if r.priority == top[0] and normal(r) == placement]
        if any(r.readers is None for r in same):
            return placement, None
        readers = {reader for r in same for reader in r.readers}
        return placement, tuple(n for n in self.nodes if n in readers)

    def check_divides(self, node: fx.Node, placement: Placement, requests: list[_Request]) -> None:
        value = self.value(node)
        if isinstance(placement, Shard) and value.shape[placement.dim] % self.plan.tp_size:
            raise PlanError(f"dynshard: {requests[0].origin} splits {node.name} (shape {list(value.shape)}) along "
                            f"dimension {placement.dim} into {self.plan.tp_size}, which does not divide it")


# -- the graph's modules ----------------------------------------------------------------------------------
def _module_stacks(nodes: list[fx.Node]) -> dict[fx.Node, dict]:
    """Each op's ``nn_module_stack``. An op that a pass added without any metadata (no stack, no source
    line: the blocks of a fused projection) runs where the first of its inputs that has one does."""
    stacks: dict[fx.Node, dict] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack")
        if not stack and not node.meta.get("stack_trace"):
            stack = next((stacks[a] for a in node.all_input_nodes if stacks.get(a)), None)
        if stack:
            stacks[node] = stack
    return stacks


def _module_calls(nodes: list[fx.Node], stacks: dict[fx.Node, dict]) -> list[Call]:
    """Every module call in the graph (keys of ``nn_module_stack`` are per call: ``id``, ``id@1``, ...),
    in the order calls start."""
    members: dict[str, list[fx.Node]] = {}
    info: dict[str, tuple[str, Any, int]] = {}
    for node in nodes:
        for depth, (key, value) in enumerate((stacks.get(node) or {}).items()):
            source, cls = value if isinstance(value, tuple) else (str(value), None)
            info.setdefault(key, (module_path(str(source)), cls, depth))
            members.setdefault(key, []).append(node)
    return [Call(key, *info[key], tuple(nodes)) for key, nodes in members.items()]


def _module_paths(calls: list[Call], state: Mapping[str, Any]) -> list[str]:
    """Paths of the graph's modules and their parents, in graph order; then modules known only by
    their parameters' names."""
    paths: dict[str, None] = {}
    for name in [call.path for call in calls] + [name.rsplit(".", 1)[0] for name in state if "." in name]:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            paths.setdefault(".".join(parts[:i]), None)
    return [p for p in paths if p]


def _innermost_path(stack: dict | None) -> str | None:
    if not stack:
        return None
    value = list(stack.values())[-1]
    return module_path(str(value[0] if isinstance(value, tuple) else value))


def _matches(pattern: str, path: str) -> bool:
    want, parts = pattern.split("."), path.split(".")
    return len(want) == len(parts) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def _module_kind(cls) -> str | None:
    if isinstance(cls, type):
        return "linear" if issubclass(cls, nn.Linear) else "embedding" if issubclass(cls, nn.Embedding) else None
    name = str(cls).removeprefix("<class '").removesuffix("'>")
    return {"torch.nn.modules.linear.Linear": "linear", "torch.nn.modules.sparse.Embedding": "embedding"}.get(name)


def _type_name(cls) -> str:
    return cls.__qualname__ if isinstance(cls, type) else str(cls)


def _same_plan(a: Propagation, b: Propagation) -> bool:
    def collectives(p):
        return sorted((c.node, c.kind, c.mesh_dim, c.bytes) for c in p.collectives)
    return a.placements == b.placements and collectives(a) == collectives(b) and a.fallbacks == b.fallbacks


def _reaches(source: fx.Node, target: fx.Node, within: set) -> bool:
    stack, seen = [target], set()
    while stack:
        node = stack.pop()
        if node is source:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(a for a in node.all_input_nodes if a in within)
    return False
