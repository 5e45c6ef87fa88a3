"""The Pyro adapter shared by every federated kernel."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from ..algorithms.rng import Randomness
from ..communication import InProcessNetwork
from ..minibatch import MinibatchSampler
from ..potential import FederatedPotential


def check_positive(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return float(value)


def check_probability(name: str, value, *, allow_zero: bool = False) -> float:
    low_ok = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low_ok(value) and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be a number in {interval}; got {value!r}.")
    return float(value)


class FederatedKernel(MCMCKernel):
    """Base class of the federated kernels: a Pyro :class:`~pyro.infer.mcmc.mcmc_kernel.MCMCKernel` that
    splits the model's data plate into clients and runs one iteration of a federated algorithm per
    :meth:`sample` call.

    Subclasses implement :meth:`init_state`, :meth:`step` and :meth:`position` by calling the pure
    functions of :mod:`pyro_fed.algorithms`. This class owns the rest: the
    :class:`~pyro_fed.potential.FederatedPotential`, the randomness, the minibatches, the network, reverting
    non-finite steps (counted as divergences) and the per-draw statistics.

    :param model: a Pyro model whose likelihood is a plate over data.
    :param clients: a LongTensor of length ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index
        tensors (see :mod:`pyro_fed.partition`).
    :param float step_size: the step size :math:`\\gamma`.
    :param int batch_size: minibatch size per client (``None``: the full local data).
    :param prior_weights: split of the prior :math:`\\varpi^i`: ``"proportional"`` (``N_i/N``),
        ``"uniform"`` (``1/b``) or a tensor.
    :param str plate: name of the data plate (found automatically when unambiguous).
    :param init_strategy: a Pyro init strategy (default: the prior median).
    :param bool trace_gradients: trace the batched model gradient into a tensor graph once per shape
        (faster); ``False`` evaluates the Pyro model eagerly at every iteration.
    """

    def __init__(
        self,
        model: Callable,
        clients,
        *,
        step_size: float,
        batch_size: int | None = None,
        prior_weights="proportional",
        plate: str | None = None,
        init_strategy: Callable = init_to_median,
        trace_gradients: bool = True,
    ):
        self.model = model
        self.trace_gradients = trace_gradients
        self.clients = clients
        self.step_size = check_positive("step_size", step_size)
        if batch_size is not None and (
            not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size must be a positive integer or None (full local data); got {batch_size!r}."
            )
        self.batch_size = batch_size
        self.prior_weights = prior_weights
        self.plate = plate
        self.init_strategy = init_strategy
        self.potential: FederatedPotential | None = None
        self._initial_params = None
        self._state = None

    # ------------------------------------------------------- subclass API
    def init_state(self, position: torch.Tensor):
        """The algorithm's initial state, all clients at ``position`` (``[d]``)."""
        raise NotImplementedError

    def step(self, state, gradients: Callable[[torch.Tensor], torch.Tensor]):
        """One iteration of the algorithm: ``(state, info)``. ``gradients`` maps client points ``[..., b, d]``
        to this iteration's minibatch gradients."""
        raise NotImplementedError

    def position(self, state) -> torch.Tensor:
        """The global iterate reported as the draw (``[d]``)."""
        raise NotImplementedError

    # ------------------------------------------------------- Pyro MCMCKernel
    def setup(self, warmup_steps: int, *args, **kwargs) -> None:
        self.potential = FederatedPotential(
            self.model,
            args,
            kwargs,
            clients=self.clients,
            plate=self.plate,
            prior_weights=self.prior_weights,
            init_strategy=self.init_strategy,
            trace_gradients=self.trace_gradients,
        )
        pot = self.potential
        # drawn from the global RNG so that pyro.set_rng_seed makes a run reproducible
        self.rng = Randomness(int(torch.randint(0, 2**62, ()).item()), pot.device)
        self.network = InProcessNetwork(pot.num_clients)
        self.minibatches = (
            (lambda: pot.full_batches)
            if self.batch_size is None
            else MinibatchSampler(pot.client_indices, self.batch_size, self.rng, pot.dtype)
        )
        if self._initial_params is None:
            self._initial_params = pot.unconstrained_params(pot.initial_flat)
        self._state = self.init_state(pot.flatten(self._initial_params).to(pot.device, pot.dtype))
        self._warmup_steps = warmup_steps
        self._records: list[dict] = []

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batches = self.minibatches()
        state, info = self.step(self._state, lambda points: self.potential.client_grads(points, batches))
        finite = torch.stack([torch.isfinite(t).all() for t in state if isinstance(t, torch.Tensor)]).all()
        # a non-finite step is reverted without waiting for the device: select, don't branch
        self._state = type(state)(
            *(
                torch.where(finite, new, old) if isinstance(new, torch.Tensor) else new
                for new, old in zip(state, self._state, strict=True)
            )
        )
        self._records.append(
            {"diverging": ~finite, "uploaded_bits": self.network.uploaded_bits, **info._asdict()}
        )
        return self.potential.unconstrained_params(self.position(self._state))

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._initial_params = params

    @property
    def transforms(self):
        return None if self.potential is None else self.potential.transforms

    def sample_stats(self) -> dict[str, np.ndarray]:
        """Per-draw statistics of the iterations after warm-up, as NumPy arrays."""
        records = self._records[self._warmup_steps :]
        if not records:
            return {}
        return {
            key: np.array([float(r[key]) if isinstance(r[key], torch.Tensor) else r[key] for r in records])
            for key in records[0]
        }

    def diagnostics(self) -> dict:
        stats = self.sample_stats()
        diverging = stats.get("diverging", np.zeros(0, bool)).astype(bool)
        return {
            "divergences": np.flatnonzero(diverging).tolist(),
            "communication rounds": self.network.rounds,
            "uploaded bits": self.network.uploaded_bits,
            "sample_stats": stats,
        }

    def logging(self) -> OrderedDict:
        return OrderedDict(
            [("rounds", self.network.rounds), ("Mbits up", f"{self.network.uploaded_bits / 1e6:.3g}")]
        )
