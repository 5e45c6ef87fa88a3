"""Graphs of agents: construction, validation, Laplacian, mixing and bits."""

import math

import pytest
import torch

from pyro_fed.network.graphs import Graph, make_graph


def test_named_graphs_and_their_laplacians():
    ring = make_graph("ring", 5)
    # the 5-ring's Laplacian spectrum is 2 - 2 cos(2 pi k / 5): largest 2 + 2 cos(pi / 5) = 3.618
    assert ring.lambda_max == pytest.approx(2 + 2 * math.cos(math.pi / 5))
    # and its smallest non-zero one 2 - 2 cos(2 pi / 5) = 1.382; a complete graph's are all n
    assert ring.spectral_gap == pytest.approx(2 - 2 * math.cos(2 * math.pi / 5))
    assert make_graph("complete", 4).spectral_gap == pytest.approx(4.0)
    assert make_graph("complete", 1).spectral_gap == 0.0
    assert ring.directed_edges == 10 and ring.exchange_bits(3) == 32 * 3 * 10
    assert make_graph("complete", 4).lambda_max == pytest.approx(4.0)
    assert make_graph("star", 4).directed_edges == 6 and make_graph("path", 4).directed_edges == 6
    torch.testing.assert_close(ring.laplacian.sum(1), torch.zeros(5, dtype=torch.float64))
    # a seeded Erdős–Rényi graph: the same graph for the same seed
    assert torch.equal(
        make_graph("erdos_renyi", 8, seed=3).adjacency, make_graph("erdos_renyi", 8, seed=3).adjacency
    )
    assert make_graph("complete", 1).lambda_max == 0.0


@pytest.mark.parametrize(
    "adjacency, match",
    [
        (torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "must be symmetric"),
        (torch.tensor([[1.0, 1.0], [1.0, 0.0]]), "zero diagonal"),
        (torch.tensor([[0.0, -1.0], [-1.0, 0.0]]), "non-negative"),
        (torch.ones(2, 3), r"square \[n, n\]"),
        (
            torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.float64),
            r"not connected: its components are \[\[0, 1\], \[2, 3\]\]",
        ),
    ],
)
def test_bad_graphs(adjacency, match):
    with pytest.raises(ValueError, match=match):
        Graph(adjacency)


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="graph='grid': use one of"):
        make_graph("grid", 4)
    with pytest.raises(ValueError, match="the graph has 3 agents but there are 4 clients"):
        make_graph(make_graph("ring", 3), 4)
