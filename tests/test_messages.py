"""pyro_fed's warnings name the user's line, not one of pyro_fed's or Pyro's, whatever the path to them."""

import warnings

import pyro
from pyro.infer import MCMC

from pyro_fed import FaldKernel, messages

from .models import gaussian_regression, sorted_regression


def test_warnings_of_a_run_point_at_the_line_that_ran_it():
    # three paths: before the draws (the drift warning, from the warm-up's settings), at the end of the run
    # (the end-of-run checks, from Pyro's MCMC asking the kernel's diagnostics) and after it (diagnostics())
    x, y, clients, _ = sorted_regression(60, 6)
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        FaldKernel(gaussian_regression(0.5), clients, comm_prob=1e-3), num_samples=20, warmup_steps=20
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(x, y)
        mcmc.diagnostics()
    ours = [w for w in caught if "pyro_fed" in str(w.message)]
    assert any("quadratic model" in str(w.message) for w in ours)  # before the draws
    assert any("end-of-run checks" in str(w.message) for w in ours)  # at the end of the run
    assert {w.filename for w in ours} == {__file__}, {(w.filename, w.lineno) for w in ours}


def test_a_warning_with_every_frame_internal_names_the_caller():
    # called from this file, whose frames are the user's: the line of the call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages.warn("pyro_fed: a test")
    assert caught[0].filename == __file__
