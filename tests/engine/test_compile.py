"""The traced graph's simplification: what computes nothing is removed, the values kept to the bit."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_fed.engine import compile as prepare_module

DATA = torch.arange(12.0).reshape(3, 4)


def wasteful(x):
    # views and expansions to the shape x already has, and terms of constants alone (the data's column sums,
    # a scalar made a tensor): what a model's trace is full of
    same = x.view(3, 4).expand(3, 4).permute(0, 1)
    scale = DATA.sum(0) * torch.tensor(2.0) + 1.0
    return (same * scale).exp().sum(-1) - torch.zeros(()).expand(()).sum()


def operations(module):
    return sum(node.op == "call_function" for node in module.graph.nodes)


def test_a_simplified_graph_computes_the_same_bits_with_fewer_operations():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    traced = make_fx(wasteful)(x)
    before = operations(traced)
    simplified = prepare_module.simplified(make_fx(wasteful)(x))
    # the aliases and the constants' arithmetic are gone: what is left reads the input
    assert operations(simplified) <= before - 6
    for node in simplified.graph.nodes:
        if node.op == "call_function":
            assert any(n.op == "placeholder" or n.op == "call_function" for n in node.all_input_nodes)
    for seed in range(3):
        y = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(simplified(y), wasteful(y)) and torch.equal(simplified(y), traced(y))


def test_random_draws_and_graphs_that_mutate_are_not_folded():
    def noisy(x):
        return x + torch.randn(3)  # a draw of constants alone: it must stay a draw

    simplified = prepare_module.simplified(make_fx(noisy)(torch.zeros(3)))
    assert not torch.equal(simplified(torch.zeros(3)), simplified(torch.zeros(3)))

    def accumulates(x):
        total = torch.zeros(3)  # a constant that the graph then changes in place
        total.add_(x)
        return total

    simplified = prepare_module.simplified(make_fx(accumulates)(torch.zeros(3)))
    first, second = simplified(torch.ones(3)), simplified(torch.ones(3))
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.ones(3))


def test_large_results_of_constants_are_computed_at_each_call_not_kept():
    big = torch.ones(prepare_module.FOLD_ELEMENTS + 1)

    def reads(x):
        return x + (big * 2.0).sum()

    simplified = prepare_module.simplified(make_fx(reads)(torch.zeros(1)))
    kept = [getattr(simplified, n.target) for n in simplified.graph.nodes if n.op == "get_attr"]
    assert all(t.numel() <= prepare_module.FOLD_ELEMENTS or t is big for t in kept)
    assert torch.equal(simplified(torch.zeros(1)), reads(torch.zeros(1)))
