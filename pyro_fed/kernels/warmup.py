"""The kernels' warm-up: the step size and the preconditioner chosen from the model's curvature
(:mod:`pyro_fed.algorithms.adaptation`), with the potential's federated gradients."""

from __future__ import annotations

import math

import torch

from ..algorithms import adaptation
from ..algorithms.rng import Randomness
from ..minibatch import MinibatchSampler

#: minibatches drawn per client to measure the gradient noise at the mode
NOISE_DRAWS = 32


def adapt(
    kernel, start: torch.Tensor, seed: int, inverse_mass: torch.Tensor | None = None
) -> adaptation.Adaptation:
    """Choose what the user left automatic in ``kernel`` (its ``step_size``, its ``preconditioner``) from
    the curvature of its potential at the mode found from ``start`` (``[d]``); the bits the clients upload
    for it are counted on ``kernel.network`` for every chain. ``seed`` seeds the minibatches of the noise
    measurement: the choice depends on neither the number of chains nor their randomness."""
    pot = kernel.potential
    b = pot.num_clients

    mode, rounds = find_mode(pot, start)
    diagonals = adaptation.client_hessian_diagonals(pot.full_gradient_fn, mode, b)
    rounds += 1  # each client uploads its diagonal
    curvature = diagonals.sum(0)
    if pot.prior_on_server:  # the server's own share of the curvature

        def prior_gradient(points: torch.Tensor) -> torch.Tensor:
            return pot.server_prior(points.reshape(-1, pot.dim), gradient=True).reshape(points.shape)

        curvature = curvature + adaptation.client_hessian_diagonals(prior_gradient, mode, 1)[0]
    if inverse_mass is None:
        inverse_mass = adaptation.preconditioner(curvature)
    scales = inverse_mass.sqrt()
    if kernel.server_step:
        # the server steps on the whole potential: the stiffness of the sum of the clients' Hessians
        def total_gradient(points: torch.Tensor) -> torch.Tensor:
            return pot.total_gradient(points[:, 0])[:, None]

        stiffness = float(adaptation.client_stiffness(total_gradient, mode, scales, 1)[0])
        clients_per_step = 1
    else:
        # each client's stiffness is computed locally and uploaded as one number (not counted: not d floats)
        stiffness = float(adaptation.client_stiffness(pot.full_gradient_fn, mode, scales, b).max())
        clients_per_step = b
    noise = 0.0
    if kernel.measures_noise():
        draws = kernel.adaptation_noise(_minibatch_gradients(kernel, seed), mode, scales)
        noise = adaptation.gradient_noise(draws, inverse_mass)
        rounds += 1  # each client uploads its variance
    step = kernel.step_size
    if step is None:
        step = kernel.chosen_step(adaptation.step_size(stiffness, noise, clients_per_step))
    kernel.network.record_averages(rounds)
    return adaptation.Adaptation(step, inverse_mass, mode, curvature, stiffness, noise, rounds)


def control_variate_error(
    minibatch_gradients, mode: torch.Tensor, scales: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """``[R, b, d]`` draws of a control variate's error: the same minibatch at a typical client point and at
    the reference point (the mode), a posterior spread apart — two independent draws differ by about
    :math:`\\sqrt 2` posterior sds per coordinate — in a direction of random signs from ``generator``."""
    signs = torch.randint(0, 2, mode.shape, generator=generator).to(mode) * 2 - 1
    both = minibatch_gradients(torch.stack([mode + math.sqrt(2.0) * scales * signs, mode]))
    return both[:, 0] - both[:, 1]


def find_mode(pot, start: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The mode of the potential ``pot`` by L-BFGS from ``start`` (see
    :func:`~pyro_fed.algorithms.adaptation.find_mode`), and the number of evaluations (rounds of uploads of
    every client's gradient and potential)."""

    def gradient(x: torch.Tensor) -> torch.Tensor:
        return pot.full_client_grads(x).sum(0) + pot.server_prior(x[None], gradient=True)[0]

    return adaptation.find_mode(pot.potential, gradient, start)


def _minibatch_gradients(kernel, seed: int):
    """``points [P, d] -> [R, P, b, d]``: every client's minibatch gradient at each point, on ``R`` fresh
    minibatches (the same minibatch at the ``P`` points)."""
    pot = kernel.potential
    if kernel.full_local_batches:
        return lambda points: pot.full_client_grads(
            points[:, None, :].expand(-1, pot.num_clients, -1)
        ).expand(NOISE_DRAWS, -1, -1, -1)
    sampler = MinibatchSampler(
        pot.client_indices,
        kernel.batch_size,
        chunk_size=NOISE_DRAWS,
        num_chains=1,
        rng=Randomness(seed, pot.device),
        dtype=pot.dtype,
    )
    indices, weights = sampler(), sampler.datum_weights  # [R, b, n], [b, n]

    def gradients(points: torch.Tensor) -> torch.Tensor:
        p, (r, b, n) = points.shape[0], indices.shape
        grads = pot.gradient_fn(
            points[None, :, None, :].expand(r, p, b, -1).reshape(-1, pot.dim),
            indices[:, None].expand(r, p, b, n).reshape(-1, n),
            weights.repeat(r * p, 1),
            pot.prior_weights.repeat(r * p),
        )
        return grads.reshape(r, p, b, pot.dim)

    return gradients
