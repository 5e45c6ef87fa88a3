"""The Pyro adapter shared by every federated kernel."""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from ..algorithms.rng import Randomness
from ..communication import InProcessNetwork
from ..minibatch import MinibatchSampler
from ..potential import FederatedPotential, check_gradient_mode


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name: str, value) -> float:
    if not _is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return float(value)


def check_probability(name: str, value, *, allow_zero: bool = False) -> float:
    low_ok = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
    if not _is_number(value) or not (low_ok(value) and value <= 1):
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
    :param str gradient_mode: ``"traced"`` (default), ``"compiled"`` (faster per iteration after seconds of
        compilation; for long runs) or ``"eager"``; see :class:`~pyro_fed.FederatedPotential`.
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
        gradient_mode: str = "traced",
    ):
        self.model = model
        self.gradient_mode = check_gradient_mode(gradient_mode)
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
        self._user_initial_params = None
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
    def build_potential(self, *args, **kwargs) -> FederatedPotential:
        """The model's split into client potentials for these model arguments (no randomness drawn but
        the init strategy's)."""
        return FederatedPotential(
            self.model,
            args,
            kwargs,
            clients=self.clients,
            plate=self.plate,
            prior_weights=self.prior_weights,
            init_strategy=self.init_strategy,
            gradient_mode=self.gradient_mode,
        )

    def setup(self, warmup_steps: int, *args, **kwargs) -> None:
        self.potential = pot = self.build_potential(*args, **kwargs)
        # drawn from the global RNG so that pyro.set_rng_seed makes a run reproducible
        self.rng = Randomness(int(torch.randint(0, 2**62, ()).item()), pot.device)
        self.network = InProcessNetwork(pot.num_clients)
        self.full_local_batches = self.batch_size is None or self.batch_size >= int(pot.client_sizes.max())
        self.minibatches = (
            (lambda: pot.full_batches)
            if self.full_local_batches
            else MinibatchSampler(pot.client_indices, self.batch_size, self.rng, pot.dtype)
        )
        # the user's initial values if given (MCMC's initial_params), else a fresh draw of the init strategy
        # for each chain and each run
        self._initial_params = self._user_initial_params or pot.unconstrained_params(pot.initial_flat)
        self._state = self.init_state(pot.flatten(self._initial_params).to(pot.device, pot.dtype))
        self._warmup_steps = warmup_steps
        self._records: list[tuple] = []  # per iteration: (finite, cumulative uploaded bits, info)

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batches = self.minibatches()
        state, info = self.step(self._state, lambda points: self.potential.client_grads(points, batches))
        # one reduction: a non-finite entry anywhere makes the sum non-finite
        finite = torch.isfinite(sum(t.sum() for t in state))
        # a non-finite step is reverted without waiting for the device: select, don't branch
        self._state = type(state)(
            *(torch.where(finite, new, old) for new, old in zip(state, self._state, strict=True))
        )
        self._records.append((finite, self.network.uploaded_bits, info))
        return self.potential.unconstrained_params(self.position(self._state))

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._initial_params = self._user_initial_params = params

    @property
    def transforms(self):
        return None if self.potential is None else self.potential.transforms

    def sample_stats(self) -> dict[str, np.ndarray]:
        """Per-draw statistics of the iterations after warm-up, as NumPy arrays: ``diverging``,
        ``uploaded_bits`` (cumulative, summed over clients, from the start of warm-up) and the fields of the
        algorithm's info (e.g. FALD's ``communicated`` and ``dispersion``)."""
        records = self._records[self._warmup_steps :]
        if not records:
            return {}
        finite, bits, infos = zip(*records, strict=True)
        stats = {"diverging": ~torch.stack(finite).cpu().numpy(), "uploaded_bits": np.array(bits)}
        for name, values in zip(infos[0]._fields, zip(*infos, strict=True), strict=True):
            stats[name] = (
                torch.stack(values).cpu().numpy() if torch.is_tensor(values[0]) else np.array(values)
            )
        return stats

    def diagnostics(self) -> dict:
        stats = self.sample_stats()
        return {
            "divergences": np.flatnonzero(stats.get("diverging", [])).tolist(),
            "communication rounds": self.network.rounds,
            "uploaded bits": self.network.uploaded_bits,
            "sample_stats": stats,
        }

    def logging(self) -> OrderedDict:
        return OrderedDict(
            [("rounds", self.network.rounds), ("Mbits up", f"{self.network.uploaded_bits / 1e6:.3g}")]
        )
