"""Pass-level behaviour in one process, on a process group that never communicates."""

from __future__ import annotations

import collections
import contextlib
import unittest.mock
import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dynshard
from dynshard.backend.capture import fqn_from_source
from dynshard.explain import format_plan
from models import GPT, MLP, GPT2StyleBlock, GPTConfig, LayerStack, gpt_batch, mlp_batch
from plans import logged_pass_graphs, plan_for, restart_fake_world


class TestPlans(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _world(self, fake_world):
        pass

    def test_zero3_plan_stores_padded_rows_and_gathers_them_in_the_compute_dtype(self):
        torch.manual_seed(0)
        plan = plan_for(MLP(dim=8, hidden=16, layers=1), mlp_batch(4, 0, dim=8), use_zero=3,
                        mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
        traced = "\n".join(f"{c.phase:8} {c.kind:14} {c.group} {c.shape} {c.bytes}" for c in plan.program.collectives)
        self.assertExpectedInline(format_plan(plan) + "\n" + traced, """\
placements
  input              kind       shape    placement
  blocks.0.0.weight  parameter  [16, 8]  Replicate(), zero3=S(0)/2
  blocks.0.0.bias    parameter  [16]     Replicate(), zero3=S(0)/2
  x                  input      [4, 8]   Replicate()
  blocks.0.2.weight  parameter  [8, 16]  Replicate(), zero3=S(0)/2
  blocks.0.2.bias    parameter  [8]      Replicate(), zero3=S(0)/2
  head.weight        parameter  [1, 8]   Replicate(), zero3=S(0)/2, 1 padding rows
  head.bias          parameter  [1]      Replicate(), zero3=S(0)/2, 1 padding rows
  y                  input      [4]      Replicate()
forward communication (predicted)
  none
forward  all_gather     dp (16, 8) 256
forward  all_gather     dp (16,) 32
forward  all_gather     dp (8, 16) 256
forward  all_gather     dp (8,) 16
forward  all_gather     dp (2, 8) 32
forward  all_gather     dp (2,) 4""")

    def test_tp_plan_of_a_transformer_layer_is_megatron(self):
        torch.manual_seed(0)
        cfg = GPTConfig(layers=1, d_model=16, heads=2)
        plan = plan_for(LayerStack(cfg), (torch.randn(2, cfg.seq, cfg.d_model),), policy="tp", plan_ngpus=2)
        self.assertExpectedInline(format_plan(plan), """\
placements
  input                      kind       shape        placement
  blocks.0.ln1.weight        parameter  [16]         tp=R
  blocks.0.ln1.bias          parameter  [16]         tp=R
  x                          input      [2, 16, 16]  tp=R
  blocks.0.attn.q.weight     parameter  [16, 16]     tp=S(0)
  blocks.0.attn.q.bias       parameter  [16]         tp=S(0)
  blocks.0.attn.k.weight     parameter  [16, 16]     tp=S(0)
  blocks.0.attn.v.weight     parameter  [16, 16]     tp=S(0)
  blocks.0.attn.v.bias       parameter  [16]         tp=S(0)
  blocks.0.attn.proj.weight  parameter  [16, 16]     tp=S(1)
  blocks.0.attn.proj.bias    parameter  [16]         tp=R
  blocks.0.ln2.weight        parameter  [16]         tp=R
  blocks.0.ln2.bias          parameter  [16]         tp=R
  blocks.0.fc1.weight        parameter  [64, 16]     tp=S(0)
  blocks.0.fc1.bias          parameter  [64]         tp=S(0)
  blocks.0.fc2.weight        parameter  [16, 64]     tp=S(1)
  blocks.0.fc2.bias          parameter  [16]         tp=R
forward communication (predicted)
  node               collective  group  bytes
  reshape_default_2  all_reduce  tp     2048
  reshape_default_4  all_reduce  tp     2048""")

    def test_data_policy_splits_the_batch_and_keeps_parameters_whole(self):
        plan = plan_for(MLP(), mlp_batch(4, 0), policy="data", plan_ngpus=2)
        placements = {inp.name: plan.placements[inp.index] for inp in plan.inputs}
        assert placements["x"] == (dynshard_placement("S0"),)
        assert all(p == (dynshard_placement("R"),) for name, p in placements.items() if name.startswith("blocks"))
        assert [c.kind for c in plan.propagation.collectives] == ["all_reduce"]   # the loss, once

    def test_data_policy_rejects_a_batch_that_does_not_divide(self):
        with pytest.raises(Exception, match="batch size 3"):
            plan_for(MLP(), mlp_batch(3, 0), policy="data", plan_ngpus=2)

    def test_tied_embedding_and_lm_head_share_one_vocab_split_under_tp(self):
        cfg = GPTConfig(layers=1)
        plan = plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2)
        placements = {inp.name: str(plan.placements[inp.index][0]) for inp in plan.inputs}
        assert placements["wte.weight"] == "S(0)"      # vocab-parallel embedding and head
        assert placements["wpe.weight"] == "R"         # positions come from arange: not a vocabulary
        assert "lm_head.weight" not in placements      # the same Parameter: one graph input
        assert not plan.propagation.fallbacks
        kinds = [c.kind for c in plan.propagation.collectives]
        assert "all_gather" not in kinds               # the logits are never gathered
        assert kinds.count("all_reduce") == 2 + 1 + 3  # the layer's pair, the embedding, the loss

    def test_callable_policy_places_parameters_by_name(self):
        def shard_first_linear(plan, config):
            assert config.pas_config["dim"] == 0
            plan.shard("blocks.0.0.weight", config.pas_config["dim"])

        plan = plan_for(MLP(), mlp_batch(4, 0), policy=shard_first_linear, plan_ngpus=2, pas_config={"dim": 0})
        sharded = {inp.name for inp in plan.inputs if str(plan.placements[inp.index][0]) != "R"}
        assert sharded == {"blocks.0.0.weight"}

    def test_callable_policy_errors_name_the_problem(self):
        with pytest.raises(Exception, match="has no parameter, buffer or input named 'nope'"):
            plan_for(MLP(), mlp_batch(4, 0), policy=lambda plan, config: plan.shard("nope", 0), plan_ngpus=2)
        with pytest.raises(Exception, match=r"dimension 0 of head.weight \(size 1\) does not divide into 2"):
            plan_for(MLP(), mlp_batch(4, 0), policy=lambda plan, config: plan.shard("head.weight", 0),
                     plan_ngpus=2)

    def test_unsupported_op_falls_back_to_replicate_with_a_warning_naming_op_and_line(self):
        class Bucketize(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.register_buffer("edges", torch.linspace(-1, 1, 5))

            def forward(self, x):
                h = self.fc(x)
                return (h + torch.searchsorted(self.edges, h.contiguous()).float()).sum()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = plan_for(Bucketize(), (torch.randn(4, 8),), plan_ngpus=2,
                            policy=lambda plan, config: plan.shard("fc.weight", 0))
        messages = [str(w.message) for w in caught if "dynshard" in str(w.message)]
        assert any("aten.searchsorted" in m and "test_passes.py" in m and "searchsorted(self.edges" in m
                   for m in messages), messages
        assert list(plan.propagation.fallbacks) == ["searchsorted"]
        assert "all_gather" in [c.kind for c in plan.propagation.collectives]

    def test_same_graph_and_shapes_are_served_from_the_plan_cache(self):
        model = MLP()
        first = plan_for(model, mlp_batch(4, 0), policy="tp", plan_ngpus=2)
        torch._dynamo.reset()
        second = plan_for(model, mlp_batch(4, 1), policy="tp", plan_ngpus=2)
        assert second is first and second.hits >= 1
        other = plan_for(model, mlp_batch(6, 0), policy="tp", plan_ngpus=2)
        assert other is not first

    def test_plans_are_stored_on_disk_for_a_restart(self):
        import tempfile

        from dynshard.backend.plan_cache import load_plan
        from dynshard.policies import BUILTIN

        with tempfile.TemporaryDirectory() as cache_dir:
            plan = plan_for(MLP(dim=8), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2, cache_dir=cache_dir)
            config = dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager", cache_dir=cache_dir)
            stored = load_plan(config, plan.key)
            assert stored == plan.plan and stored.tensors["blocks.0.0.weight"].tp == "S0"

            def must_not_run(plan, config):
                raise AssertionError("the stored plan should have been used")

            restart_fake_world()     # a new job: nothing in memory
            torch._dynamo.reset()
            with unittest.mock.patch.dict(BUILTIN, {"tp": must_not_run}):
                again = plan_for(MLP(dim=8), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2,
                                 cache_dir=cache_dir)
            assert again.placements == plan.placements and again is not plan


def dynshard_placement(text: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def test_parameter_names_come_from_dynamo_sources():
    assert fqn_from_source("L['self']._modules['blocks']._modules['0']._parameters['weight']") == "blocks.0.weight"
    assert fqn_from_source("L['x']") is None


@pytest.mark.parametrize("layers,style", [(1, "separate q/k/v"), (3, "separate q/k/v"), (2, "fused q|k|v"),
                                          (2, "GPT-2 Conv1D")])
def test_tensor_parallel_transformer_layers_cost_megatrons_minimum(fake_world, layers, style):
    """2 all-reduces forward and 2 backward per layer, and nothing else, however the layer is written."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers, fused_qkv=style == "fused q|k|v")
    stack = LayerStack(cfg, GPT2StyleBlock if style == "GPT-2 Conv1D" else None)
    model = torch.compile(stack, backend="dynshard",
                          options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    model(torch.randn(2, cfg.seq, cfg.d_model)).backward()
    report = dynshard.explain(model)
    counts = collections.Counter((c.phase, c.kind) for c in report.collectives())
    assert counts == {("forward", "all_reduce"): 2 * layers, ("backward", "all_reduce"): 2 * layers}, str(report)
    activation = 2 * cfg.seq * cfg.d_model * 4
    assert {c.bytes for c in report.collectives()} == {activation}


def test_inference_only_programs_run_without_autograd(fake_world):
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="dynshard",
                             options={"policy": "dp", "inference_only": True, "compiler": "aot_eager"})
    x, y = mlp_batch(4, 0)
    out = compiled(x, y)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(x, y).detach())
    assert dynshard.explain(compiled).collectives() == []


def test_planning_on_the_meta_device_gives_the_same_plan(fake_world):
    torch.manual_seed(0)
    inputs = mlp_batch(4, 0)
    on_device = plan_for(MLP(), inputs, policy="tp", plan_ngpus=2)
    torch._dynamo.reset()
    on_meta = plan_for(MLP(), inputs, policy="tp", plan_ngpus=2, trace_strategy="meta")
    assert on_meta.placements == on_device.placements


@pytest.mark.parametrize("options", [{}, {"pas_config": {"sequence_parallel": True}}])
def test_a_policys_trials_run_only_what_they_change_and_plan_the_same(fake_world, options):
    """Each trial of the tp policy (one column split) reuses the values an earlier propagation computed
    before the first node the trial changes and after the point where its values rejoin the earlier ones;
    DTensor's answers are kept by op signature across the repeated layers. The plan is the one that
    propagating everything every time, asking DTensor at every node, gives."""
    import sys

    from dynshard.runtime.job import new_job

    propagation = sys.modules["dynshard.passes.propagate_sharding"]
    memo = sys.modules["dynshard.passes.op_memo"]
    cfg = GPTConfig(layers=4)
    ran = []
    run_node = propagation.ShardingInterpreter.run_node

    def counting(interpreter, node):
        ran.append(node)
        return run_node(interpreter, node)

    def plan(*patches):
        torch._dynamo.reset()
        new_job()           # planned again, not served from the job's plans
        torch.manual_seed(0)
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            return format_plan(plan_for(GPT(cfg), gpt_batch(cfg, 4, 0), policy="tp", plan_ngpus=2, **options))

    count = unittest.mock.patch.object(propagation.ShardingInterpreter, "run_node", counting)
    # (layers replayed whole, test_layer_memo.py, would cut both counts: measured without them)
    no_layers = unittest.mock.patch.object(propagation, "repeated_layers", lambda gm: {})
    with_reuse = plan(count, no_layers)
    nodes_with_reuse, ran[:] = len(ran), []
    no_reuse = unittest.mock.patch.object(propagation, "reusable_prefix", lambda *args: ({}, None))
    assert with_reuse == plan(count, no_reuse, no_layers) == plan(no_reuse)
    assert nodes_with_reuse < 0.5 * len(ran), (nodes_with_reuse, len(ran))
    forget = [unittest.mock.patch.object(memo.OpMemo, "keep", lambda *args: None),
              unittest.mock.patch.object(memo.OpMemo, "input", lambda self, mesh, meta, placements, make:
                                         make(meta, placements)),
              unittest.mock.patch.object(memo.OpMemo, "redistribute", lambda self, value, mesh, placements:
                                         value.redistribute(mesh, placements))]
    assert with_reuse == plan(no_reuse, *forget)


class TestSequenceParallelPlans(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _world(self, fake_world):
        pass

    def test_sequence_parallel_reduce_scatters_partials_and_gathers_matmul_inputs_along_the_sequence(self):
        cfg = GPTConfig(layers=1)
        plan = plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2,
                        pas_config={"sequence_parallel": True})
        self.assertExpectedInline(format_plan(plan), """\
placements
  input                      kind       shape      placement
  idx                        input      [2, 16]    tp=R
  wte.weight                 parameter  [64, 32]   tp=S(0)
  wpe.weight                 parameter  [16, 32]   tp=R
  blocks.0.ln1.weight        parameter  [32]       tp=R
  blocks.0.ln1.bias          parameter  [32]       tp=R
  blocks.0.attn.q.weight     parameter  [32, 32]   tp=S(0)
  blocks.0.attn.q.bias       parameter  [32]       tp=S(0)
  blocks.0.attn.k.weight     parameter  [32, 32]   tp=S(0)
  blocks.0.attn.v.weight     parameter  [32, 32]   tp=S(0)
  blocks.0.attn.v.bias       parameter  [32]       tp=S(0)
  blocks.0.attn.proj.weight  parameter  [32, 32]   tp=S(1)
  blocks.0.attn.proj.bias    parameter  [32]       tp=R
  blocks.0.ln2.weight        parameter  [32]       tp=R
  blocks.0.ln2.bias          parameter  [32]       tp=R
  blocks.0.fc1.weight        parameter  [128, 32]  tp=S(0)
  blocks.0.fc1.bias          parameter  [128]      tp=S(0)
  blocks.0.fc2.weight        parameter  [32, 128]  tp=S(1)
  blocks.0.fc2.bias          parameter  [32]       tp=R
  ln_f.weight                parameter  [32]       tp=R
  ln_f.bias                  parameter  [32]       tp=R
  targets                    input      [2, 16]    tp=R
activations placed by the policy
  node               placement  for
  embedding          tp=S(1)    every reader
  getitem            tp=R       view, view_2, view_3
  reshape_default_2  tp=S(1)    every reader
  getitem_5          tp=R       view_11
  reshape_default_4  tp=S(1)    every reader
  getitem_8          tp=R       view_15
forward communication (predicted)
  node               collective      group  bytes
  embedding          reduce_scatter  tp     4096
  getitem            all_gather      tp     4096
  reshape_default_2  reduce_scatter  tp     4096
  getitem_5          all_gather      tp     4096
  reshape_default_4  reduce_scatter  tp     4096
  getitem_8          all_gather      tp     4096
  nll_loss_forward   all_reduce      tp     128
  nll_loss_forward   all_reduce      tp     128
  nll_loss_forward   all_reduce      tp     128""")

    def test_batch_parallel_runs_the_layers_pinned_whole_on_batch_shards_and_gathers_for_the_split_ones(self):
        """Attention pinned whole reads the norm's batch shard (no gather before q, k, v: their weights are
        whole); the MLP's input is gathered for fc1 only, and its partial output reduce-scattered along the
        batch, as the vocabulary-parallel embedding's."""
        cfg = GPTConfig(layers=1)
        plan = plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2,
                        pas_config={"batch_parallel": True}, partition_constraints={"blocks.*.attn": "replicate"})
        self.assertExpectedInline(format_plan(plan), """\
placements
  input                      kind       shape      placement
  idx                        input      [2, 16]    tp=R
  wte.weight                 parameter  [64, 32]   tp=S(0)
  wpe.weight                 parameter  [16, 32]   tp=R
  blocks.0.ln1.weight        parameter  [32]       tp=R
  blocks.0.ln1.bias          parameter  [32]       tp=R
  blocks.0.attn.q.weight     parameter  [32, 32]   tp=R
  blocks.0.attn.q.bias       parameter  [32]       tp=R
  blocks.0.attn.k.weight     parameter  [32, 32]   tp=R
  blocks.0.attn.v.weight     parameter  [32, 32]   tp=R
  blocks.0.attn.v.bias       parameter  [32]       tp=R
  blocks.0.attn.proj.weight  parameter  [32, 32]   tp=R
  blocks.0.attn.proj.bias    parameter  [32]       tp=R
  blocks.0.ln2.weight        parameter  [32]       tp=R
  blocks.0.ln2.bias          parameter  [32]       tp=R
  blocks.0.fc1.weight        parameter  [128, 32]  tp=S(0)
  blocks.0.fc1.bias          parameter  [128]      tp=S(0)
  blocks.0.fc2.weight        parameter  [32, 128]  tp=S(1)
  blocks.0.fc2.bias          parameter  [32]       tp=R
  ln_f.weight                parameter  [32]       tp=R
  ln_f.bias                  parameter  [32]       tp=R
  targets                    input      [2, 16]    tp=R
activations placed by the policy
  node               placement  for
  embedding          tp=S(0)    every reader
  getitem_5          tp=R       view_11
  reshape_default_4  tp=S(0)    every reader
  getitem_8          tp=R       view_15
forward communication (predicted)
  node               collective      group  bytes
  embedding          reduce_scatter  tp     4096
  getitem_5          all_gather      tp     4096
  reshape_default_4  reduce_scatter  tp     4096
  getitem_8          all_gather      tp     4096
  nll_loss_forward   all_reduce      tp     128
  nll_loss_forward   all_reduce      tp     128
  nll_loss_forward   all_reduce      tp     128""")

    def test_tp_refuses_sequence_and_batch_parallel_together(self):
        cfg = GPTConfig(layers=1)
        with pytest.raises(Exception, match="sets both sequence_parallel and batch_parallel"):
            plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2,
                     pas_config={"sequence_parallel": True, "batch_parallel": True})

    def test_tp_refuses_an_unknown_option(self):
        cfg = GPTConfig(layers=1)
        with pytest.raises(Exception, match="the tp policy has no option 'sequence_paralel'"):
            plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2,
                     pas_config={"sequence_paralel": True})


class TestMixedPrecisionPlans:
    @pytest.fixture(autouse=True)
    def _world(self, fake_world):
        pass

    @pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused_qkv"])
    def test_tp_splits_the_same_parameters_when_they_are_cast_to_the_compute_dtype(self, fused):
        cfg = GPTConfig(layers=1, fused_qkv=fused)
        placements = [{inp.name: str(plan.placements[inp.index][0]) for inp in plan.inputs} for plan in (
            plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2, **options)
            for options in ({}, {"mixed_precision": {"param_dtype": "bfloat16"}}))]
        assert placements[0] == placements[1]
        assert placements[1]["blocks.0.fc1.weight"] == "S(0)" and placements[1]["wte.weight"] == "S(0)"


class MultiQueryBlock(nn.Module):
    """A pre-norm layer whose attention has one key/value head for all query heads (multi-query), with
    the repeat written as transformers' ``repeat_kv`` (expand + reshape); attention by
    ``scaled_dot_product_attention`` or by hand (``q @ k^T``, softmax, ``@ v``)."""

    def __init__(self, d_model: int = 32, heads: int = 4, by_hand: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.by_hand = heads, d_model // heads, by_hand
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, self.head_dim, bias=False)
        self.v = nn.Linear(d_model, self.head_dim, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = (p(h).view(B, T, 1, self.head_dim).transpose(1, 2)[:, :, None]
                .expand(B, 1, self.heads, T, self.head_dim).reshape(B, self.heads, T, self.head_dim)
                for p in (self.k, self.v))
        if self.by_hand:
            y = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("by_hand", [False, True], ids=["sdpa", "matmul"])
def test_tp_splits_query_heads_of_multi_query_attention_and_keeps_key_value_whole(fake_world, by_hand):
    """One k/v head cannot be split over 2 ranks: q and the output projection are split by heads, k and
    v stay whole and are sliced locally where attention repeats them (no gather of q). Forward: Megatron's
    2 all-reduces per layer. Backward: 2, and one more for each of k and v, whose gradients are sums over
    every rank's query heads."""
    torch.manual_seed(0)
    layers = 2
    stack = nn.Sequential(*(MultiQueryBlock(by_hand=by_hand) for _ in range(layers)))
    x = torch.randn(2, 16, 32)
    plan = plan_for(stack, (x,), policy="tp", plan_ngpus=2)
    placements = {inp.name: str(plan.placements[inp.index][0]) for inp in plan.inputs}
    for i in range(layers):
        assert [placements[f"{i}.{name}.weight"] for name in ("q", "k", "v", "proj", "fc1", "fc2")] == \
            ["S(0)", "R", "R", "S(1)", "S(0)", "S(1)"], format_plan(plan)
    # k and v of each layer: sliced by the matched-slice rule before attention written as matmuls; CPU flash
    # attention is one op, whose heads strategy slices them itself (a local reshard, gradients kept sliced)
    assert len(plan.propagation.matched_slices) == (2 * layers if by_hand else 0), format_plan(plan)
    assert not plan.propagation.fallbacks and [c.kind for c in plan.propagation.collectives] == \
        ["all_reduce"] * 2 * layers, format_plan(plan)

    torch._dynamo.reset()
    model = torch.compile(stack, backend="dynshard",
                          options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    model(x).square().mean().backward()
    report = dynshard.explain(model)
    shapes = collections.Counter((c.phase, c.kind, tuple(c.shape)) for c in report.collectives())
    kv = sum(n for (phase, _, shape), n in shapes.items() if phase == "backward" and shape != (2, 16, 32))
    assert shapes[("forward", "all_reduce", (2, 16, 32))] == 2 * layers, str(report)
    assert shapes[("backward", "all_reduce", (2, 16, 32))] == 2 * layers and kv == 2 * layers, str(report)
    assert sum(shapes.values()) == 6 * layers, str(report)


def test_the_passes_run_in_four_phases_and_the_graph_after_each_is_logged_when_asked(fake_world):
    """``TORCH_LOGS=+dynshard.passes`` switches the ``dynshard.passes`` logger to DEBUG: each pass's graph."""
    from dynshard import passes

    assert list(passes.PHASES) == ["lower", "place", "propagate", "rewrite"]
    assert passes.PLACE == [passes.assign_placements] and passes.PROPAGATE == [passes.propagate_sharding]
    records = logged_pass_graphs(MLP(), mlp_batch(4, 0), policy="tp", plan_ngpus=2)
    ran = [message.split(":")[0].removeprefix("graph after ") for message in records]
    assert ran == [p.__name__ for phase in passes.PHASES.values() for p in phase], ran
    rewritten = records[ran.index("insert_collectives")]
    assert "insert_collectives_to_boundary" in rewritten and "to_boundary" not in records[0], rewritten
