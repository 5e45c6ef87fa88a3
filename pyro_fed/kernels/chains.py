"""Vectorized chains under Pyro's own ``MCMC(kernel, num_chains=C)``.

Pyro's :class:`~pyro.infer.MCMC` runs chains in worker processes when the machine has a core to spare for
each, and one after another otherwise; either way each chain is a separate run of the kernel. A federated
kernel simulates all its clients as one batched tensor, and ``C`` chains are just ``C`` times more rows: one
batched state ``[C, b, d]`` and one model evaluation per iteration cost far less than ``C`` runs.

So that ``MCMC(FaldKernel(model), num_chains=C)`` does that with the user's code unchanged, importing
pyro_fed wraps ``MCMC.__init__``: when (and only when) the kernel is a pyro_fed kernel, it tells the kernel
the number of chains, of draws and the initial values, and uses Pyro's single-process sampler. The kernel
then computes all chains together during the first chain's run and serves the other chains' draws from its
buffers when Pyro asks for them. With the clients held in several processes
(:mod:`pyro_fed.network.distributed`), only the first shows the progress bar. Pyro's own kernels (NUTS,
HMC...) are untouched.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from pyro.infer import MCMC
from pyro.infer.mcmc.api import _UnarySampler

from .base import ChainPlan, FederatedKernel


def install() -> None:
    """Wrap ``MCMC.__init__`` (once)."""
    original = MCMC.__init__
    if getattr(original, "_pyro_fed", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        with warnings.catch_warnings():
            # Pyro warns that chains beyond the free cores run one after another: ours run as one batch
            warnings.filterwarnings("ignore", message="num_chains=.*available_cpu")
            original(self, *args, **kwargs)
        if not isinstance(self.kernel, FederatedKernel):
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        num_chains = arguments["num_chains"]
        initial_params = arguments["initial_params"]
        self.kernel.plan = ChainPlan(num_chains, self.num_samples, initial_params if num_chains > 1 else None)
        # with clients held in several processes, the progress bar of the first only: all run the same draws
        quiet = arguments["disable_progbar"] or getattr(self.kernel._network, "rank", 0) != 0
        # worker processes: one process does all chains
        if not isinstance(self.sampler, _UnarySampler) or quiet != arguments["disable_progbar"]:
            self.sampler = _UnarySampler(
                self.kernel,
                self.num_samples,
                self.warmup_steps,
                num_chains,
                quiet,
                initial_params=initial_params,
                hook=arguments["hook_fn"],
            )

    __init__._pyro_fed = True
    MCMC.__init__ = __init__
