r"""QLSD — Quantised Langevin stochastic dynamics, and its variance-reduced variants.

The server holds :math:`\theta`. Each iteration every client is active with probability :math:`p` (the set
:math:`A`); an active client uploads a compressed gradient estimate, and the server takes one Langevin step:

.. math::

    g_i = Q(H^i - \eta^i), \qquad
    g = \frac{b}{|A|} \sum_{i \in A} g_i + \sum_{i=1}^b \eta^i, \qquad
    \theta \leftarrow \theta - \gamma g + \sqrt{2\gamma}\, Z, \qquad
    \eta^i \leftarrow \eta^i + \alpha g_i \ (i \in A),

where :math:`Q` is a compressor (:mod:`pyro_fed.network.compression`), :math:`\eta^i` a memory the server
mirrors (:math:`\alpha = 0`: none) and :math:`H^i` client :math:`i`'s estimate of :math:`\nabla U^i(\theta)`:

- no control variate (QLSD, QLSD#): :math:`H^i = \hat\nabla U^i(\theta; S^i)`;
- ``"fixed_point"`` (QLSD⋆): :math:`H^i = \hat\nabla U^i(\theta; S^i) - \hat\nabla U^i(\theta_\star; S^i)`,
  biased per client but unbiased in sum since :math:`\nabla U(\theta_\star) = 0`;
- ``"svrg"`` (QLSD++): :math:`H^i = \hat\nabla U^i(\theta; S^i) - \hat\nabla U^i(\zeta; S^i)
  + \nabla U^i(\zeta)` around a snapshot :math:`\zeta` that becomes :math:`\theta` every :math:`l`
  iterations (each client then computes its full local gradient there).

The three are one rule around a reference point :math:`\zeta` (fixed at :math:`\theta_\star`, or the
snapshot) with reference gradients :math:`G^i` (zero for the fixed point, :math:`\nabla U^i(\zeta)` for the
snapshot): :math:`H^i = \hat\nabla U^i(\theta; S) - \hat\nabla U^i(\zeta; S) + G^i`. When no client is active
(:math:`A = \emptyset`, probability :math:`(1 - p)^b`) the server steps with :math:`g = \sum_i \eta^i` —
the memories are its best estimate of the gradient; without memory that is a noise-only step.

Tensors carry a leading chain dimension ``C``; the compressor's uniforms, the participation coins and the
server noise are inputs of :func:`step`, drawn ahead for a chunk.

**Reference:** Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic dynamics
for Bayesian federated learning*, AISTATS 2022, Algorithms 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .langevin import langevin_step


class QlsdState(NamedTuple):
    server: torch.Tensor  #: :math:`\theta`, ``[C, d]``
    memory: torch.Tensor  #: :math:`\eta^i`, ``[C, b, d]``
    reference: torch.Tensor  #: :math:`\zeta` (fixed point or snapshot), ``[C, d]``
    reference_grads: torch.Tensor  #: :math:`G^i`, ``[C, b, d]``


def init(positions: torch.Tensor, num_clients: int, reference_grads: Callable | None) -> QlsdState:
    """The server of chain ``c`` at ``positions[c]`` (``[C, d]``), no memory, and the reference point at the
    start (``reference_grads`` maps points ``[C, d]`` to the clients' full gradients ``[C, b, d]``; ``None``
    for no control variate or a fixed point, whose reference is set by :func:`with_reference`)."""
    c, d = positions.shape
    memory = positions.new_zeros(c, num_clients, d)
    grads = memory.clone() if reference_grads is None else reference_grads(positions)
    return QlsdState(positions.clone(), memory, positions.clone(), grads)


def with_reference(state: QlsdState, reference: torch.Tensor, grads: torch.Tensor) -> QlsdState:
    """``state`` with the reference point :math:`\\zeta` (``[C, d]``) and gradients :math:`G^i`
    (``[C, b, d]``)."""
    return state._replace(reference=reference, reference_grads=grads)


def position(state: QlsdState, network) -> torch.Tensor:
    """The reported draw: the server's :math:`\\theta`, ``[C, d]`` (the same wherever clients are held:
    the ``network`` is not needed, and taken for the signature every algorithm shares)."""
    return state.server


def memory_rate(control_variate: str | None, omega: float) -> float:
    """The memories' rate :math:`\\alpha` by default: :math:`1/(\\omega + 1)` for ``"svrg"`` (QLSD++, with
    :math:`\\omega` the compressor's variance bound), else 0 (no memory). Algorithm 2 of the paper."""
    return 1.0 / (omega + 1.0) if control_variate == "svrg" else 0.0


def snapshot(state: QlsdState, full_gradients: Callable) -> QlsdState:
    """QLSD++'s snapshot: the reference point becomes the server's :math:`\\theta` and each client computes
    its full local gradient there (``full_gradients`` maps ``[C, d]`` to ``[C, b, d]``)."""
    return with_reference(state, state.server.clone(), full_gradients(state.server))


def server_gradient(prior_gradient: Callable, state: QlsdState, control_variate: str | None) -> torch.Tensor:
    """The server's own term of :math:`g` when it holds the prior: :math:`\\nabla U^0(\\theta)`
    (``prior_gradient`` maps ``[C, d]`` to ``[C, d]``); with the fixed point's control variate, minus
    :math:`\\nabla U^0(\\theta_\\star)`, because the clients send differences of their likelihoods'
    gradients to the fixed point, whose sum there is :math:`-\\nabla U^0(\\theta_\\star)`, not 0."""
    prior = prior_gradient(state.server)
    if control_variate == "fixed_point":
        prior = prior - prior_gradient(state.reference)
    return prior


def estimates(
    state: QlsdState, gradients: Callable, control_variate: str | None, network, exact_gradients: bool = False
) -> torch.Tensor:
    """The clients' estimates :math:`H^i` of :math:`\\nabla U^i(\\theta)`, ``[C, b, d]``. With
    ``exact_gradients`` (full local batches) the SVRG estimate is :math:`\\nabla U^i(\\theta) - \\nabla
    U^i(\\zeta) + \\nabla U^i(\\zeta) = \\nabla U^i(\\theta)`: one evaluation, not two."""
    b = state.memory.shape[-2]
    server = network.broadcast(state.server, b)
    if control_variate is None or (control_variate == "svrg" and exact_gradients):
        return gradients(server)
    both = gradients(torch.stack([server, network.broadcast(state.reference, b)]))
    return both[0] - both[1] + state.reference_grads


def step(
    state: QlsdState,
    gradients: Callable,
    noise: torch.Tensor,
    uniforms: torch.Tensor | None,
    active: torch.Tensor,
    network,
    compressor,
    *,
    step_size: torch.Tensor,
    memory_rate: float,
    control_variate: str | None,
    server_gradient: torch.Tensor | None = None,
    exact_gradients: bool = False,
) -> QlsdState:
    """One QLSD iteration.

    :param gradients: maps client points ``[..., C, b, d]`` to this iteration's minibatch gradients.
    :param noise: the server's Gaussian noise, ``[C, d]``.
    :param uniforms: the compressor's uniforms, ``[C, b, d]`` (``None`` for a deterministic compressor).
    :param active: which clients take part, ``[C, b]`` boolean.
    :param compressor: a :class:`~pyro_fed.network.compression.Compressor`.
    :param step_size: :math:`\\gamma` (a tensor: a scalar or per coordinate).
    :param float memory_rate: :math:`\\alpha`.
    :param control_variate: ``None``, ``"fixed_point"`` or ``"svrg"``.
    :param server_gradient: :math:`\\nabla U^0(\\theta)`, ``[C, d]``, when the server holds the prior.
    :param bool exact_gradients: the minibatches are the clients' full data (see :func:`estimates`).
    """
    uploads = compressor.compress(
        estimates(state, gradients, control_variate, network, exact_gradients) - state.memory, uniforms
    )
    uploads = torch.where(active[..., None], uploads, torch.zeros_like(uploads))
    estimate = aggregate(uploads, active, state.memory, network)
    if server_gradient is not None:
        estimate = estimate + server_gradient
    return state._replace(
        server=langevin_step(state.server, estimate, step_size, noise),
        memory=state.memory + memory_rate * uploads,
    )


def aggregate(uploads: torch.Tensor, active: torch.Tensor, memory: torch.Tensor, network) -> torch.Tensor:
    """The server's estimate :math:`g = \\frac{b}{|A|} \\sum_{i \\in A} g_i + \\sum_i \\eta^i`, ``[..., d]``,
    from the uploads ``[..., b, d]``, the participation ``[..., b]`` and the memories ``[..., b, d]``, summed
    over the clients by the ``network``. With no active client the first term is 0."""
    uploads = torch.where(active[..., None], uploads, torch.zeros_like(uploads))
    count = network.sum(active, -1).unsqueeze(-1).to(uploads.dtype)
    weight = torch.where(count > 0, network.num_clients / count.clamp_min(1.0), torch.zeros_like(count))
    return weight * network.sum(uploads) + network.sum(memory)
