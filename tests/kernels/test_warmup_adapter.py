"""WarmupAdapter: the warm-up's record is the kernel's, and its one line says what it chose."""

import logging
import warnings

import pyro
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel, QlsdKernel
from pyro_fed.kernels.warmup_adapter import WarmupAdapter

from ..models import logistic_model, regression_data


def run(kernel, num_samples=30, warmup=40):
    x, y = regression_data(80)
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run: the end-of-run checks ask for more draws
        mcmc.run(x, (y > 0).double())
    return mcmc


def test_the_warmup_says_what_it_chose_in_one_line(caplog):
    kernel = FaldKernel(logistic_model, 4)
    with caplog.at_level(logging.INFO, logger="pyro_fed"):
        run(kernel)
    chosen = kernel.adaptation
    assert isinstance(kernel.warmup, WarmupAdapter) and chosen is kernel.warmup.chosen
    said = [r.getMessage() for r in caplog.records if r.name == "pyro_fed"]
    assert said == [kernel.warmup.summary()]  # once, before the draws
    line = said[0]
    assert "\n" not in line and line.startswith("pyro_fed's warm-up for FaldKernel")
    # the figures the record holds, as the line rounds them
    assert f"step {chosen.step_size:.3g}" in line and f"thinning {chosen.thinning}" in line
    assert ("dense" if chosen.preconditioner.dim() == 2 else "diagonal") + " preconditioner" in line
    assert f"{chosen.rounds} rounds" in line
    assert kernel.diagnostics()["warm-up"] == line


def test_a_chosen_communication_setting_is_in_the_line():
    kernel = QlsdKernel(logistic_model, 4, quantization_levels="auto")
    run(kernel)
    levels = kernel.adaptation.quantization_levels
    assert f"quantization levels {levels:.3g}" in kernel.warmup.summary()


def test_nothing_is_said_when_the_user_gave_everything(caplog):
    kernel = FaldKernel(logistic_model, 4, step_size=1e-3, preconditioner=torch.ones(3))
    with caplog.at_level(logging.INFO, logger="pyro_fed"):
        run(kernel, warmup=5)
    assert kernel.adaptation is None and kernel.warmup.summary() == ""
    assert not [r for r in caplog.records if r.name == "pyro_fed"]
    assert kernel.diagnostics()["warm-up"] is None
    assert kernel.current_step_size == 1e-3 and kernel.current_thinning == 1
