"""Recompute by module (Config.recompute_modules): the tags, the saved bytes, the numbers, the traffic."""

from __future__ import annotations

import collections
import importlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

import dynshard
from dynshard import compat
from distributed import run_ranks
from dynshard.passes.context import PassContext
from dynshard.planning.outline import outline_of
from models import GPT, GPTConfig, gpt_batch
from parity import assert_losses_close
from workers_recompute import single_process_scenarios, tensor_parallel_scenarios

tag_recompute = importlib.import_module("dynshard.passes.tag_recompute")
LOSS_RTOL = 1e-6    # the losses, held tighter than parity's standard (1e-5)
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def lowered(model, inputs) -> torch.fx.GraphModule:
    """The single-process ATen graph of ``model(*inputs)``, as dynshard tags it (no process group)."""
    graphs = []

    def backend(gm, example_inputs):
        config = dynshard.Config(recompute_modules="ROOT")
        ctx = PassContext(config=config, outline=outline_of(config, 1), layout=None, inputs=[],
                          fake_mode=compat.new_fake_mode())
        graphs.append(tag_recompute.tag_single_process(gm, example_inputs, ctx))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def retag(gm: torch.fx.GraphModule, names: str) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)
    tag_recompute.tag_graph(gm, dynshard.Config(recompute_modules=names).recompute_names)
    return gm


def regions(gm) -> dict[str, set[int]]:
    """Innermost module path of each recomputed op -> the region ids it got."""
    found = collections.defaultdict(set)
    for node in gm.graph.nodes:
        if node.meta.get("recompute") == RECOMPUTE:
            stack = tag_recompute.frames(node)
            found[stack[-1].path if stack else ""].add(node.meta["ac_graph_id"])
    return found


@pytest.fixture(scope="module")
def gpt_aten():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig()
    return lowered(GPT(cfg), gpt_batch(cfg, 2, 0))


def test_a_class_name_makes_one_region_per_instance_in_forward_order(gpt_aten):
    found = regions(retag(gpt_aten, "Block"))
    assert set(found) == {f"blocks.{i}{part}" for i in (0, 1) for part in
                          ("", ".ln1", ".ln2", ".fc1", ".fc2", ".attn", ".attn.q", ".attn.k", ".attn.v", ".attn.proj")}
    first, second = ({i for path, ids in found.items() if path.startswith(f"blocks.{b}") for i in ids} for b in (0, 1))
    assert len(first) == 1 and len(second) == 1 and min(first) < min(second)


@pytest.mark.parametrize("names, expected", [
    ("blocks.1", {"blocks.1"}),                       # a path
    ("attn", {"blocks.0.attn", "blocks.1.attn"}),     # a dotted suffix of paths
    ("blocks.*", {"blocks.0", "blocks.1"}),           # a wildcard component
    ("*Attention", {"blocks.0.attn", "blocks.1.attn"}),
    ("Block,attn", {"blocks.0", "blocks.1"}),         # nested matches: the outermost instance is the region
])
def test_names_match_paths_suffixes_wildcards_and_nesting(gpt_aten, names, expected):
    gm = retag(gpt_aten, names)
    ids = collections.defaultdict(set)
    for node in gm.graph.nodes:
        if node.meta.get("recompute") == RECOMPUTE:
            region = next(f.path for f in tag_recompute.frames(node)
                          if any(tag_recompute.matches(n, f) for n in names.split(",")))
            ids[region].add(node.meta["ac_graph_id"])
    assert set(ids) == expected
    assert all(len(v) == 1 for v in ids.values()) and len(set().union(*ids.values())) == len(expected)


def test_root_recomputes_every_forward_op_as_one_region(gpt_aten):
    gm = retag(gpt_aten, "ROOT")
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(n.meta.get("recompute") == RECOMPUTE for n in ops)
    assert len({n.meta["ac_graph_id"] for n in ops}) == 1


def test_random_ops_are_saved_not_recomputed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    gm = retag(lowered(model, (torch.randn(4, 8),)), "Sequential")
    rng = [n for n in gm.graph.nodes if tag_recompute.is_rng(n)]
    assert rng and all(n.meta["recompute"] == CheckpointPolicy.MUST_SAVE for n in rng)   # the dropout mask
    assert any(n.meta.get("recompute") == RECOMPUTE for n in gm.graph.nodes)


def test_an_unknown_name_is_refused_with_the_modules_the_graph_has(gpt_aten):
    with pytest.raises(Exception, match=r"'Blok'.*match no module.*classes: .*Block.*CausalSelfAttention"
                                        r".*paths: .*blocks\.0\.attn\.q"):
        retag(gpt_aten, "Block,Blok")


# -- training: one process, and tensor parallelism over 2 gloo ranks ------------------------------------

@pytest.fixture(scope="module")
def single():
    return run_ranks(single_process_scenarios, 1)[0]


@pytest.fixture(scope="module")
def tp():
    return run_ranks(tensor_parallel_scenarios, 2)


def test_single_process_recompute_cuts_saved_bytes_and_keeps_the_losses(single):
    plain, block = single["plain"], single["block"]
    assert block["saved_bytes"] <= 0.4 * plain["saved_bytes"], (plain["saved_bytes"], block["saved_bytes"])
    # the blocks' matmuls run again, but fc2's: its output feeds only the block's, which the next region keeps
    # (autodist prices this set). Unrolled, the last block's output feeds the final norm, outside any
    # recompute region, so the partitioner runs that block's fc2 again too
    assert block["backward_matmuls"] - plain["backward_matmuls"] == 5 * GPTConfig().layers + 1
    assert_losses_close(block["losses"], plain["losses"], rtol=LOSS_RTOL)
    assert_losses_close(block["losses"], block["ref_losses"], rtol=LOSS_RTOL)
    assert f"saved for backward: {block['saved_bytes']} bytes" in block["explain"]


def test_an_unknown_module_name_fails_the_first_call_with_a_clear_error(single):
    assert "'Blok', which match no module of the compiled graph" in single["unknown"]
    assert "classes: Block, CausalSelfAttention, Embedding, LayerNorm, Linear" in single["unknown"]


def test_tensor_parallel_recompute_cuts_saved_bytes_without_communicating_again(tp):
    for rank in tp:
        plain, block = rank["plain"], rank["block"]
        # (0.43 here: flash attention saves only its output and log-sum-exp, so the plain plan's saved set is
        # small already, and what lies outside the blocks, the vocabulary's logits, is a larger share of it)
        assert block["saved_bytes"] <= 0.5 * plain["saved_bytes"], (plain["saved_bytes"], block["saved_bytes"])
        # not the projections whose outputs are all-reduced (the reduced value is kept): q, k, v and fc1
        assert block["backward_matmuls"] - plain["backward_matmuls"] == 4 * GPTConfig().layers
        assert_losses_close(block["losses"], plain["losses"], rtol=LOSS_RTOL)
        assert_losses_close(block["losses"], block["ref_losses"], rtol=LOSS_RTOL)     # single-process eager
        _same_communication(block["collectives"], plain["collectives"])
        # 2 per layer, the vocab-parallel embedding's and the cross-entropy's 3 of one value per row;
        # backward: 2 per layer and the LM head's input gradient (and, as in the plain program, the
        # cross-entropy's max that aot_eager's default partitioner recomputes outside the blocks)
        assert block["collectives"][("forward", "all_reduce", "tp")] == 4 + 1 + 3
        assert block["collectives"][("backward", "all_reduce", "tp")] == plain["collectives"][
            ("backward", "all_reduce", "tp")] == 4 + 1 + 1
        # the blocks are compiled once, recomputed, and communicate in the backward only what they must
        assert block["in_blocks"] == plain["in_blocks"] == {("forward", "all_reduce", "tp"): 4,
                                                            ("backward", "all_reduce", "tp"): 4}


def test_a_user_checkpoint_still_works_under_tensor_parallelism(tp):
    for rank in tp:
        user, plain = rank["user"], rank["plain"]
        assert_losses_close(user["losses"], user["ref_losses"], rtol=LOSS_RTOL)
        assert user["saved_bytes"] < plain["saved_bytes"] and user["backward_matmuls"] > plain["backward_matmuls"]
        _same_communication(user["collectives"], plain["collectives"])


def _same_communication(recomputed, plain) -> None:
    """Recompute sends nothing more. (Without it, aot_eager's partitioner recomputes the cross-entropy's
    all-reduce of one max per row in the backward; with it, that value is saved: one fewer.)"""
    assert recomputed[("forward", "all_reduce", "tp")] == plain[("forward", "all_reduce", "tp")]
    assert plain[("backward", "all_reduce", "tp")] - recomputed[("backward", "all_reduce", "tp")] in (0, 1)
    assert {k for k in recomputed if k[1] != "all_reduce"} == {k for k in plain if k[1] != "all_reduce"} == set()
