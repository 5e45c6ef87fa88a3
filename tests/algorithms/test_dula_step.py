"""D-ULA's automatic constant step: the consensus analysis in the agents' quadratic model."""

import math

import pytest
import torch

from pyro_fed.algorithms import dula_step
from pyro_fed.network.graphs import make_graph


def test_the_consensus_step_is_ulas_for_identical_agents_and_shrinks_with_heterogeneity():
    ring = make_graph("ring", 8)
    same = torch.full((8, 3), 1 / 8)
    # identical agents: the average is ULA whatever the disagreement; 0.18 keeps its variance within 10%
    assert (
        dula_step.consensus_analysis(
            0.18, same, torch.zeros(8, 3), ring, 1 / 4, variance_target=0.1, mean_target=0.1
        ).step
        == 0.18
    )
    # one agent holding most of a coordinate's curvature, others pulling its mean: a smaller step
    skewed = same.clone()
    skewed[:, 0] = torch.tensor([0.65] + [0.05] * 7)
    pulls = torch.zeros(8, 3)
    pulls[:, 0] = torch.linspace(-3, 3, 8)
    alpha = dula_step.consensus_analysis(
        0.18, skewed, pulls, ring, 1 / 4, variance_target=0.1, mean_target=0.1
    ).step
    assert alpha < 0.18
    assert alpha == pytest.approx(
        0.18 * dula_step.CONSENSUS_SHRINK ** round(math.log(alpha / 0.18, dula_step.CONSENSUS_SHRINK))
    )


def test_the_consensus_analysis_measures_from_the_models_mode_not_from_where_the_search_stopped():
    # a diagonal quadratic model of 8 agents on a ring: curvature shares c_i and gradients g_i at the mode
    # (summing to zero). At a point delta posterior sds off the mode in a coordinate, the agents' gradients
    # are g_i + c_i delta: the same agents, the same step. Measured from that point, a delta beyond the mean
    # target (0.1 sds) was met by no step: the step shrank 60 times, to 1e-6 of the warm-up's
    ring = make_graph("ring", 8)
    beta = 1 / ring.lambda_max
    generator = torch.Generator().manual_seed(0)
    shares = torch.rand(8, 3, generator=generator) + 0.1
    shares = shares / shares.sum(0)
    pulls = 3 * torch.randn(8, 3, generator=generator)
    pulls = pulls - pulls.mean(0)
    targets = {"variance_target": 0.1, "mean_target": 0.1}
    at_mode = dula_step.consensus_analysis(0.05, shares, pulls, ring, beta, **targets)
    assert at_mode.met and at_mode.step < 0.05  # heterogeneous agents: a smaller step than the warm-up's
    for delta in (0.05, 0.3, 1.0):
        off = pulls + shares * torch.tensor([delta, 0.0, -delta])
        found = dula_step.consensus_analysis(0.05, shares, off, ring, beta, **targets)
        assert found.met and found.step == pytest.approx(at_mode.step, rel=1e-12)
        assert dula_step.consensus_analysis(0.05, shares, off, ring, beta, **targets).step == found.step
