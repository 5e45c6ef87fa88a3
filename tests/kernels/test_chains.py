"""``import pyro_fed`` wraps Pyro's ``MCMC.__init__`` to run a pyro_fed kernel's chains as one batch; any
other kernel must run exactly as Pyro runs it unwrapped."""

import pyro
import torch
from pyro.infer import MCMC, NUTS

import pyro_fed  # noqa: F401 - the import installs the wrapper

from ..models import logistic_model, regression_data


def nuts_draws(monkeypatch, wrapped: bool) -> dict:
    if not wrapped:
        monkeypatch.setattr(MCMC, "__init__", MCMC.__init__.__wrapped__)
    x, y = regression_data(num_data=30, dim=2)
    y = (y > 0).double()
    pyro.set_rng_seed(3)
    mcmc = MCMC(NUTS(logistic_model), num_samples=20, warmup_steps=20, num_chains=1, disable_progbar=True)
    mcmc.run(x, y)
    return mcmc.get_samples()


def test_other_kernels_run_as_pyro_runs_them(monkeypatch):
    assert getattr(MCMC.__init__, "_pyro_fed", False), "the wrapper is installed by import pyro_fed"
    with_wrapper = nuts_draws(monkeypatch, wrapped=True)
    without = nuts_draws(monkeypatch, wrapped=False)
    torch.testing.assert_close(with_wrapper["w"], without["w"], rtol=0, atol=0)
