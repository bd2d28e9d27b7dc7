"""dynshard.tensor_parallel: a parallelize_module plan (torch's ParallelStyles) as a dynshard policy."""

from __future__ import annotations

import collections
import json
import pickle

import expecttest
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel)

import dynshard
from distributed import run_ranks
from dynshard.explain import format_plan
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch
from parity import assert_trains_like_one_process
from plans import plan_for
from workers_styles import megatron_plan, sequence_parallel_plan, train_with_styles


def _gpt_plan(policy, **options):
    torch._dynamo.reset()
    cfg = GPTConfig(layers=1)
    torch.manual_seed(0)
    return plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy=policy, plan_ngpus=2, **options)


class TestDeclarativePlans(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _world(self, fake_world):
        pass

    def test_megatron_plan_places_what_the_tp_policy_finds(self):
        plan = _gpt_plan(dynshard.tensor_parallel(megatron_plan()))
        # the automatic policy's plan, to the character (placements and predicted communication)
        assert format_plan(plan) == format_plan(_gpt_plan("tp"))

    def test_sequence_parallel_plan_reduce_scatters_and_gathers_along_the_sequence(self):
        plan = _gpt_plan(dynshard.tensor_parallel(sequence_parallel_plan()))
        # the plan printed by test_passes for the automatic policy, to the character
        assert format_plan(plan) == format_plan(_gpt_plan("tp", pas_config={"sequence_parallel": True}))

    def test_embeddings_rowwise_split_the_vocabulary_and_colwise_the_features(self):
        # the LM head is tied to wte: one parameter, placed once (vocab-parallel logits and loss)
        plan = _gpt_plan(dynshard.tensor_parallel({
            "wte": RowwiseParallel(), "wpe": ColwiseParallel(output_layouts=Replicate())}))
        self.assertExpectedInline(format_plan(plan), """\
placements
  input                      kind       shape      placement
  idx                        input      [2, 16]    tp=R
  wte.weight                 parameter  [64, 32]   tp=S(0)
  wpe.weight                 parameter  [16, 32]   tp=S(1)
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
  blocks.0.fc1.weight        parameter  [128, 32]  tp=R
  blocks.0.fc1.bias          parameter  [128]      tp=R
  blocks.0.fc2.weight        parameter  [32, 128]  tp=R
  blocks.0.fc2.bias          parameter  [32]       tp=R
  ln_f.weight                parameter  [32]       tp=R
  ln_f.bias                  parameter  [32]       tp=R
  targets                    input      [2, 16]    tp=R
activations placed by the policy
  node         placement  for
  embedding_1  tp=R       every reader
forward communication (predicted)
  node              collective  group  bytes
  embedding         all_reduce  tp     4096
  embedding_1       all_gather  tp     2048
  nll_loss_forward  all_reduce  tp     128
  nll_loss_forward  all_reduce  tp     128
  nll_loss_forward  all_reduce  tp     128""")

    def test_prepare_module_input_and_output_place_what_enters_and_leaves_a_module(self):
        # blocks.0 reads the user input x: it is split where it enters the program; blocks.1's output is
        # gathered where blocks.1 produces it
        torch.manual_seed(0)
        plan = plan_for(MLP(), mlp_batch(4, 0), plan_ngpus=2, policy=dynshard.tensor_parallel({
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(0)),
            "blocks.1": PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Shard(0),
                                                 output_layouts=Shard(0), desired_output_layouts=Replicate()),
        }))
        self.assertExpectedInline(format_plan(plan), """\
placements
  input              kind       shape     placement
  blocks.0.0.weight  parameter  [32, 16]  tp=R
  blocks.0.0.bias    parameter  [32]      tp=R
  x                  input      [4, 16]   tp=S(0)
  blocks.0.2.weight  parameter  [16, 32]  tp=R
  blocks.0.2.bias    parameter  [16]      tp=R
  blocks.1.0.weight  parameter  [32, 16]  tp=R
  blocks.1.0.bias    parameter  [32]      tp=R
  blocks.1.2.weight  parameter  [16, 32]  tp=R
  blocks.1.2.bias    parameter  [16]      tp=R
  head.weight        parameter  [1, 16]   tp=R
  head.bias          parameter  [1]       tp=R
  y                  input      [4]       tp=R
activations placed by the policy
  node          placement  for
  add_tensor_3  tp=R       every reader
forward communication (predicted)
  node          collective  group  bytes
  add_tensor_3  all_gather  tp     256
  mean          all_reduce  tp     4""")

    def test_a_module_called_twice_is_placed_at_each_call_and_entries_apply_in_order(self):
        class Shared(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

            def forward(self, x):
                for _ in range(2):
                    x = x + self.down(torch.relu(self.up(x)))
                return x.square().mean()

        torch.manual_seed(0)
        # and two entries on one module act in order, as torch's hooks: up's output is gathered
        plan = plan_for(Shared(), (torch.randn(4, 8),), plan_ngpus=2, policy=dynshard.tensor_parallel({
            "up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(0)),
            "u?": PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate())}))
        self.assertExpectedInline(format_plan(plan), """\
placements
  input        kind       shape    placement
  up.weight    parameter  [16, 8]  tp=S(0)
  up.bias      parameter  [16]     tp=S(0)
  x            input      [4, 8]   tp=R
  down.weight  parameter  [8, 16]  tp=S(1)
  down.bias    parameter  [8]      tp=R
activations placed by the policy
  node          placement  for
  add_tensor    tp=R       every reader
  relu          tp=S(1)    mm_default_1
  mm_default_1  tp=S(0)    every reader
  add           tp=R       mm_default_2
  add_tensor_2  tp=R       every reader
  relu_1        tp=S(1)    mm_default_3
  mm_default_3  tp=S(0)    every reader
forward communication (predicted)
  node          collective      group  bytes
  add_tensor    all_gather      tp     256
  mm_default_1  reduce_scatter  tp     128
  add           all_gather      tp     128
  add_tensor_2  all_gather      tp     256
  mm_default_3  reduce_scatter  tp     128
  mean          all_reduce      tp     4""")


def test_plans_that_cannot_be_followed_raise_plan_errors_that_say_why(fake_world):
    with pytest.raises(Exception, match=r"plan key 'blocks\.\*\.attn\.wq' matches no module of the compiled "
                                        r"graph .*blocks\.0\.attn\.q"):
        _gpt_plan(dynshard.tensor_parallel({"blocks.*.attn.wq": ColwiseParallel()}))
    with pytest.raises(Exception, match=r"ColwiseParallel takes nn.Linear or nn.Embedding, but "
                                        r"'blocks.\*.ln1' \(ColwiseParallel on blocks.0.ln1\) is LayerNorm"):
        _gpt_plan(dynshard.tensor_parallel({"blocks.*.ln1": ColwiseParallel()}))
    # the LM head is tied to the token embedding: it cannot be split two ways
    with pytest.raises(Exception, match=r"places wte.weight as S\(1\) by 'wte' .* and as S\(0\) by 'lm_head'"):
        _gpt_plan(dynshard.tensor_parallel({"wte": ColwiseParallel(), "lm_head": ColwiseParallel()}))
    with pytest.raises(Exception, match=r"gives 2 input layouts \(2 not None\) but 1 values enter blocks.0.attn"):
        _gpt_plan(dynshard.tensor_parallel({"blocks.*.attn": PrepareModuleInput(
            input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate()))}))


def test_unknown_styles_are_refused_when_the_policy_is_made():
    class Float8Colwise(ColwiseParallel):
        pass

    with pytest.raises(dynshard.PlanError, match="is a subclass of ColwiseParallel"):
        dynshard.tensor_parallel({"fc": Float8Colwise()})
    with pytest.raises(dynshard.PlanError, match="not a style dynshard knows; use one of ColwiseParallel"):
        dynshard.tensor_parallel({"fc": "colwise"})
    with pytest.raises(dynshard.PlanError, match="not a module path pattern"):
        dynshard.tensor_parallel({"blocks..fc": ColwiseParallel()})


def test_without_strict_a_pattern_for_another_graph_is_skipped(fake_world):
    plan = _gpt_plan(dynshard.tensor_parallel({"layers.*.wq": ColwiseParallel(), "blocks.*.fc1": ColwiseParallel()},
                                              strict=False))
    split = {inp.name for inp in plan.inputs if str(plan.placements[inp.index][0]) != "R"}
    assert split == {"blocks.0.fc1.weight", "blocks.0.fc1.bias"}


def test_the_policy_is_a_picklable_value_keyed_by_its_plan():
    policy = dynshard.tensor_parallel(sequence_parallel_plan())
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and again.cache_token() == policy.cache_token()
    token = policy.cache_token()
    assert '"blocks.*.attn.proj", {"input_layouts": ["Shard(dim=-1)"], "output_layouts": ["Shard(dim=1)"], ' \
           '"style": "RowwiseParallel"}' in token
    assert "use_local_output" not in token     # ignored, so it does not change the plan
    lm_head_local = dynshard.tensor_parallel({**sequence_parallel_plan(), "lm_head": ColwiseParallel(
        input_layouts=Shard(1))})
    assert lm_head_local.cache_token() == token
    other = dynshard.tensor_parallel({**sequence_parallel_plan(), "blocks.*.fc2": RowwiseParallel()})
    assert other.cache_token() != token
    assert json.loads(dynshard.Config(policy=policy, plan_ngpus=2).cache_token())["policy"] == token


def test_declarative_sequence_parallel_gpt_trains_like_one_process():
    results = run_ranks(train_with_styles, 2)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
    first = results[0]
    assert first["moved"] > 1e-3          # the steps changed the parameters: the comparison means something
    dims = first["parallel_dims"]
    assert dims["wte.weight"] == 0 and dims["blocks.1.attn.q.weight"] == 0 and dims["blocks.1.fc2.weight"] == 1
    assert dims["blocks.1.ln1.weight"] is None, first["explain"]
    forward = collections.Counter(kind for phase, kind, _ in first["collectives"] if phase == "forward")
    layers = GPTConfig().layers
    # per layer 2 reduce-scatters and 2 all-gathers; the embedding's reduce-scatter and the LM head's gather
    assert forward["reduce_scatter"] == 2 * layers + 1 and forward["all_gather"] == 2 * layers + 1, first["explain"]
    assert forward["all_reduce"] == 3, first["explain"]     # the vocab-parallel loss, one value per row
