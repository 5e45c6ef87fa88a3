"""The traced graph's simplification (what computes nothing is removed) and its interpretation by
TorchScript: the values kept to the bit."""

import pytest
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


def test_a_trace_describes_its_values_with_one_fake_tensor_mode_and_computes_the_same_bits():
    # make_fx alone makes a fake-tensor mode per operation (each recording the Python stack, a third of the
    # tracing time); traced() makes one for the whole trace, which TorchInductor's C++ wrapper also needs
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    graph = prepare_module.traced(wasteful, (x,))

    def modes(module):
        values = (n.meta.get("val") for n in module.graph.nodes)
        return {id(v.fake_mode) for v in values if isinstance(v, torch.Tensor)}

    assert len(modes(graph)) == 1 and len(modes(make_fx(wasteful)(x))) > 1
    assert torch.equal(graph(x), wasteful(x))


def test_random_draws_and_constants_written_in_place_are_not_folded():
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


def test_a_graph_writing_its_own_intermediate_in_place_still_folds_its_constants():
    def clipped(x):
        # the constant offset is folded; the sum, written in place (as a log-density's support mask is),
        # and the view of it stay computed at each call
        y = x + torch.ones(3) * 2.0
        y.view(3).masked_fill_(y > 4.0, 0.0)
        return y

    traced = make_fx(clipped)(torch.zeros(3))
    before = operations(traced)
    simplified = prepare_module.simplified(make_fx(clipped)(torch.zeros(3)))
    assert operations(simplified) <= before - 2
    for value in ([0.0, 1.0, 3.0], [5.0, -1.0, 2.5]):
        x = torch.tensor(value)
        assert torch.equal(simplified(x), clipped(x)) and torch.equal(simplified(x), clipped(x))


def iteration(x, noise):
    # an iteration as the kernels trace one: arithmetic, reductions, a select and an in-place write
    step = x - 0.1 * torch.tanh(x) * x.pow(2).sum(-1, keepdim=True) + noise
    step.masked_fill_(step.abs() > 1e3, 0.0)
    return torch.where(torch.isfinite(step), step, x), step.mean()


def test_a_traced_function_runs_in_torchscript_with_the_graphs_bits():
    x = torch.randn(4, 10, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = torch.randn(4, 10, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    prepared = prepare_module.prepare(iteration, (x, noise), "traced", what="a test iteration")
    assert prepared.mode == "traced" and prepared.interpreted is not None
    for _ in range(5):  # past the executor's profiling calls, chained as the kernels chain iterations
        (expected, mean), (got, got_mean) = prepared.function(x, noise), prepared(x, noise)
        assert torch.equal(got, expected) and torch.equal(got_mean, mean)
        x = got
    # the inputs the checks ran on were copies
    assert torch.equal(
        noise, torch.randn(4, 10, 7, generator=torch.Generator().manual_seed(1), dtype=noise.dtype)
    )


def test_a_prepared_function_called_while_another_is_traced_is_traced_through():
    x, noise = torch.ones(2, 3), torch.zeros(2, 3)
    prepared = prepare_module.prepare(iteration, (x, noise), "traced", what="a test iteration")
    outer = make_fx(lambda x, noise: prepared(x, noise)[0] * 2.0)(x, noise)
    # the outer graph holds the inner one's ATen operations, not a call of the TorchScript module
    assert all(
        node.target is not prepared.interpreted and "jit" not in str(node.target)
        for node in outer.graph.nodes
    )
    assert operations(outer) > 5
    assert torch.equal(outer(x, noise), iteration(x, noise)[0] * 2.0)


def test_a_graph_writing_a_constant_in_place_is_neither_folded_nor_interpreted():
    counts = torch.zeros(3)  # state kept across calls in a tensor the function closes over

    def counting(x):
        counts.add_(1.0)
        return x + counts * 2.0

    module = prepare_module.simplified(make_fx(counting)(torch.zeros(3)))
    # every call sees the count its predecessors left: nothing computed from it was folded
    assert torch.equal(module(torch.zeros(3)), torch.full((3,), 4.0))
    assert torch.equal(module(torch.zeros(3)), torch.full((3,), 6.0))
    # the checks' calls would change it: the graph runs as it is
    assert prepare_module.interpreted(module, (torch.zeros(3),)) is None
    assert torch.equal(counts, torch.full((3,), 3.0))
    # eager functions are not interpreted
    x = (torch.ones(3), torch.zeros(3))
    assert prepare_module.prepare(iteration, x, "eager", what="a test iteration").interpreted is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_on_the_gpu_are_not_interpreted():
    x = (torch.ones(3, device="cuda"), torch.zeros(3, device="cuda"))
    assert prepare_module.prepare(iteration, x, "traced", what="a test iteration").interpreted is None


def test_large_results_of_constants_are_computed_at_each_call_not_kept():
    big = torch.ones(prepare_module.FOLD_ELEMENTS + 1)

    def reads(x):
        return x + (big * 2.0).sum()

    simplified = prepare_module.simplified(make_fx(reads)(torch.zeros(1)))
    kept = [getattr(simplified, n.target) for n in simplified.graph.nodes if n.op == "get_attr"]
    assert all(t.numel() <= prepare_module.FOLD_ELEMENTS or t is big for t in kept)
    assert torch.equal(simplified(torch.zeros(1)), reads(torch.zeros(1)))


def test_follows_from_tells_a_value_that_left_torch_during_a_trace():
    # a sum computed from the input follows from it; the same sum through NumPy and back is a constant of
    # the trace (its first call's value), which follows from nothing; outside a trace, nothing is judged
    seen, outside = {}, torch.ones(2)  # a tensor the trace does not follow: made before it

    def function(x):
        total = x.sum(0)
        wired = torch.from_numpy(total.detach().numpy().copy())
        seen["computed"] = prepare_module.follows_from(total, (x,))
        seen["wired"] = prepare_module.follows_from((total, wired), (x,))
        seen["unfollowed input"] = prepare_module.follows_from(wired, (outside,))
        return total + wired

    prepare_module.traced(function, (torch.ones(3, 2),))
    assert seen == {"computed": True, "wired": False, "unfollowed input": True}
    assert prepare_module.follows_from(torch.ones(2), (torch.ones(2),))
