r"""Every kernel with every default, ``MCMC(Kernel(model, clients))``, against NUTS on the pooled data, on
models written the way Pyro users write them.

What is measured
----------------
Nine models, each with its data made here from a fixed seed (Titanic: the table shipped with the package),
each split into clients as its data would be in the world:

- ``regression``: linear regression, 4 standardised features, a ``HalfNormal`` noise scale (``N = 1000``,
  10 i.i.d. clients);
- ``regression_sites``: the same over 10 **heterogeneous** clients (``N = 5000``, 6 coefficients and the
  noise scale): each client holds a range of the second feature, and its features are shifted by a
  client-specific offset (covariate shift);
- ``poisson``: a Poisson GLM with a log link, 3 features (``N = 1000``, 10 i.i.d. clients);
- ``student_t``: a Student-t likelihood whose degrees of freedom are learned (``Gamma(2, 0.1)`` prior),
  with its scale, on heavy-tailed data (``N = 1000``): the posterior's curvatures span two orders;
- ``hierarchical``: a logistic regression with per-site intercepts drawn around a learned mean with a
  learned ``HalfNormal`` scale (non-centred), 2 features, 8 sites of different sizes and base rates, one
  client per site (``partition.by_group``);
- ``bnn``: a ``PyroModule`` network, one input, 3 ``tanh`` units, a learned noise scale (``N = 200``);
  its weights are not identifiable (the units can be permuted and their signs flipped), so what is
  compared is the regression function :math:`f(x)` at 8 inputs, the noise scale, and nothing else;
- ``mvn_lkj``: a 3-dimensional normal with unknown mean, ``HalfNormal`` scales and an ``LKJCholesky(3, 2)``
  correlation prior (``N = 500``); compared on the mean, the scales and the three free entries of the
  Cholesky factor; TorchInductor cannot compile its potential, so every compiled function falls back;
- ``titanic``: the README's logistic regression on the Titanic table (2201 people);
- ``scales_100x``: a linear regression whose features have scales 1, 10 and 0.1, so that its posterior
  sds differ by 100x (``N = 500``, known noise).

The kernels, each at its defaults: FALD (``FaldKernel(model, clients)``), VR-FALD⋆, QLSD++
(``QlsdKernel(model, clients, control_variate="svrg")``: the option names the algorithm), D-ULA (its
default ring over the clients) and SGLD (``SgldKernel(model)``, the pooled data); 4 chains of 500 warm-up
and 1000 draws each (the draws are thinned automatically, about half an autocorrelation time apart).
Pyro's NUTS on the pooled data (two chains, 500 warm-up + 1000 draws each; on ``bnn`` with
``max_tree_depth=6``, as its default depth of 10 costs about a second per draw) is the reference. The
network's posterior mixes slowly for every sampler, so on ``bnn`` NUTS gets two chains of 3000 draws and
the kernels ``thinning=1500`` (the user's choice the end-of-run checks point to) with 4 chains of 500 + 5000
draws. Per compared quantity :math:`j`:

- ``mean err`` = :math:`\max_j |\hat\mu_j - \mu^{NUTS}_j| / \sigma^{NUTS}_j` (target ≤ 0.2);
- ``sd err`` = :math:`\max_j |\hat\sigma_j / \sigma^{NUTS}_j - 1|` (target ≤ 0.15);
- ``ESS/s``: the min over quantities of ArviZ's bulk ESS, divided by the wall time of ``mcmc.run``
  (warm-up, adaptation, tracing and compilation included; all chains of the run pooled); target: at least
  NUTS's on every model but ``bnn``;
- what the warm-up chose: the step, the minibatch, the thinning, the preconditioner's form with the
  condition number :math:`\kappa` the diagonal one leaves (the dense one is taken above 4, above 2 up to 16
  coordinates), and whether the end-of-run checks warned.

Both errors include the Monte Carlo error of both runs (the table prints both ESS: with ESS :math:`E`, a
mean has standard error :math:`\sigma/\sqrt E` and an sd about :math:`1/\sqrt{2E}` relative), so a run
passes only with enough effective draws: ``MC sd`` is :math:`\sqrt{1/E + 1/E_{NUTS}}`, the standard
deviation of one quantity's ``mean err`` from Monte Carlo error alone (the max over quantities is larger),
and ``R-hat`` the largest rank-normalised split R-hat over the quantities.

On ``bnn`` the sd ratios of :math:`f` are printed per input, inside and outside the data's range. On
``scales_100x`` FALD with the best *isotropic* step of the same stability
(:math:`\gamma = 0.2\, b / \lambda_{\max}(\nabla^2 U)`, no preconditioner, the pooled Hessian used to set
it) is run too: its widest coordinate moves 10^4 times slower.

Run::

    python benchmarks/defaults.py                      # all models and kernels (hours: bnn is most of it)
    python benchmarks/defaults.py --models titanic --kernels FALD   # these rows only (the others kept)
    python benchmarks/defaults.py --nuts-cache /tmp/nuts   # keep and reuse NUTS references
    python benchmarks/defaults.py --quick              # fewer draws, a smoke run (a few minutes)

Results: ``benchmarks/results/defaults{,_quick}.{md,json}`` (``--out`` changes the folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from common import logistic_regression
from pyro.infer import MCMC, NUTS
from pyro.nn import PyroModule, PyroSample

import pyro_fed
from pyro_fed import FaldKernel

MEAN_TARGET, SD_TARGET = 0.2, 0.15


# ---------------------------------------------------------------------------------------------- models
def regression(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


def poisson(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Poisson(rate=(x[idx] @ w).exp()), obs=y[idx])


def student_t(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    nu = pyro.sample("nu", dist.Gamma(2.0, 0.1))
    scale = pyro.sample("scale", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.StudentT(nu, x[idx] @ w, scale), obs=y[idx])


class Network(PyroModule):
    """One input, ``HIDDEN`` tanh units, one output; standard normal priors on every weight."""

    HIDDEN = 3

    def __init__(self):
        super().__init__()
        h = self.HIDDEN
        self.hidden = PyroModule[torch.nn.Linear](1, h)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([h, 1]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([h]).to_event(1))
        self.output = PyroModule[torch.nn.Linear](h, 1)
        self.output.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, h]).to_event(2))
        self.output.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y):
        # the weights are sampled before the data plate (read once per evaluation, not per datum)
        weights = (self.hidden.weight, self.hidden.bias, self.output.weight, self.output.bias)
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Normal(regression_function(x[idx], *weights), sigma), obs=y[idx])


def regression_function(x, w1, b1, w2, b2):
    """The network's output at inputs ``x [n, 1]`` (for any leading batch of weights)."""
    hidden = torch.tanh(x[..., None, :, :] @ w1.transpose(-1, -2) + b1[..., None, :])
    return (hidden @ w2.transpose(-1, -2) + b2[..., None, :])[..., 0]


def mvn_lkj(y):
    dim = y.shape[1]
    mean = pyro.sample("mean", dist.Normal(0.0, 5.0).expand([dim]).to_event(1))
    scales = pyro.sample("scales", dist.HalfNormal(2.0).expand([dim]).to_event(1))
    cholesky = pyro.sample("cholesky", dist.LKJCholesky(dim, 2.0))
    with pyro.plate("data", y.shape[0]) as idx:
        pyro.sample("y", dist.MultivariateNormal(mean, scale_tril=scales[:, None] * cholesky), obs=y[idx])


def hierarchical(x, site, y, num_sites):
    """Logistic regression with per-site intercepts around a learned mean, with a learned scale
    (non-centred: the intercepts are ``mu + tau * z``)."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([num_sites]).to_event(1))
    intercepts = mu + tau * z
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w + intercepts[site[idx]]), obs=y[idx])


def known_noise_regression(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=y[idx])


BNN_GRID = torch.linspace(-2.5, 2.5, 8)


def bnn_quantities(samples: dict) -> dict:
    """The identifiable quantities of the network: :math:`f` at ``BNN_GRID`` and the noise scale."""
    weights = [samples[f"{layer}.{kind}"] for layer in ("hidden", "output") for kind in ("weight", "bias")]
    f = regression_function(BNN_GRID.to(weights[0])[:, None], *weights)
    return {"f": f, "sigma": samples["sigma"]}


def lkj_quantities(samples: dict) -> dict:
    rows, cols = torch.tril_indices(3, 3, offset=-1)
    return {
        "mean": samples["mean"],
        "scales": samples["scales"],
        "cholesky": samples["cholesky"][:, rows, cols],
    }


class Problem(NamedTuple):
    model: Callable
    data: tuple
    select: Callable | None  #: the compared quantities from the samples (``None``: every site)
    clients: object  #: the ``clients`` argument of the federated kernels


def make_problems() -> dict[str, Problem]:
    g = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    problems = {}
    x = normal(1000, 4)
    problems["regression"] = Problem(
        regression, (x, x @ torch.tensor([0.5, -1.0, 0.0, 2.0]) + 0.7 * normal(1000)), None, 10
    )
    # heterogeneous sites, from their own seeded generator (the other models' data stay those of earlier
    # runs): each client a range of the second feature, its other features shifted by its own offset
    h = torch.Generator().manual_seed(2)
    x = torch.randn(5000, 6, generator=h)
    sites = torch.empty(5000, dtype=torch.long)
    sites[x[:, 1].argsort()] = torch.arange(5000) * 10 // 5000
    x[:, 2:] += torch.randn(10, 4, generator=h)[sites]
    y = x @ torch.tensor([0.5, -1.0, 0.3, 2.0, 0.0, -0.7]) + 1.5 * torch.randn(5000, generator=h)
    problems["regression_sites"] = Problem(regression, (x, y), None, sites)
    x = torch.cat([torch.ones(1000, 1), 0.5 * normal(1000, 2)], 1)
    problems["poisson"] = Problem(
        poisson, (x, torch.poisson((x @ torch.tensor([1.0, 0.5, -0.3])).exp(), generator=g)), None, 10
    )
    x = torch.cat([torch.ones(1000, 1), normal(1000, 2)], 1)
    # Student-t(4) noise, a normal over the root of a chi-square(4) / 4, from its own seeded generator
    t = torch.Generator().manual_seed(1)
    noise = torch.randn(1000, generator=t) / torch.randn(1000, 4, generator=t).square().mean(-1).sqrt()
    problems["student_t"] = Problem(
        student_t, (x, x @ torch.tensor([0.3, 1.0, -0.5]) + 0.5 * noise), None, 10
    )
    # 8 sites of 50 to 400 people, base rates around -0.5 with sd 0.8, one client each
    k = torch.Generator().manual_seed(3)
    sizes = torch.tensor([50, 80, 120, 150, 200, 250, 300, 400])
    site = torch.repeat_interleave(torch.arange(8), sizes)
    x = torch.randn(len(site), 2, generator=k)
    logits = x @ torch.tensor([0.8, -0.5]) + (-0.5 + 0.8 * torch.randn(8, generator=k))[site]
    y = torch.bernoulli(torch.sigmoid(logits), generator=k)
    problems["hierarchical"] = Problem(hierarchical, (x, site, y, 8), None, pyro_fed.partition.by_group(site))
    x = 2.0 * torch.rand(200, 1, generator=g) - 1.0
    y = torch.sin(2.0 * x[:, 0]) + 0.2 * normal(200)
    problems["bnn"] = Problem(Network(), (x * 2.0, y), bnn_quantities, 10)
    correlation = torch.tensor([[1.0, 0.6, -0.3], [0.6, 1.0, 0.2], [-0.3, 0.2, 1.0]])
    scale_tril = torch.linalg.cholesky(correlation) * torch.tensor([1.0, 2.0, 0.5])[:, None]
    problems["mvn_lkj"] = Problem(
        mvn_lkj, (torch.tensor([1.0, -2.0, 0.5]) + normal(500, 3) @ scale_tril.T,), lkj_quantities, 10
    )
    problems["titanic"] = Problem(logistic_regression, pyro_fed.datasets.titanic(), None, 10)
    x = normal(500, 3) * torch.tensor([1.0, 10.0, 0.1])
    problems["scales_100x"] = Problem(
        known_noise_regression, (x, x @ torch.tensor([1.0, -0.1, 5.0]) + 0.5 * normal(500)), None, 10
    )
    return problems


#: the kernels, each at its defaults (the options name the algorithm: QLSD++'s control variate)
KERNELS = {
    "FALD": lambda model, clients: FaldKernel(model, clients),
    "VR-FALD*": lambda model, clients: pyro_fed.VrFaldKernel(model, clients),
    "QLSD++": lambda model, clients: pyro_fed.QlsdKernel(model, clients, control_variate="svrg"),
    "D-ULA": lambda model, clients: pyro_fed.DulaKernel(model, clients),
    "SGLD": lambda model, clients: pyro_fed.SgldKernel(model),
}


# ------------------------------------------------------------------------------------------ measuring
def quantities(mcmc: MCMC, select) -> dict[str, np.ndarray]:
    """``{name: [chains, draws, k]}`` of the compared quantities (sites with zero spread, such as the
    Cholesky factor's fixed entries, are left out by ``select``)."""
    samples = mcmc.get_samples(group_by_chain=True)
    chains = next(iter(samples.values())).shape[0]
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
    chosen = select(flat) if select else flat
    return {
        k: v.reshape(chains, -1, *v.shape[1:]).reshape(chains, v.shape[0] // chains, -1).numpy()
        for k, v in chosen.items()
    }


def ess(values: dict) -> float:
    return float(min(np.min(az.ess(az.convert_to_dataset({k: v}))[k].values) for k, v in values.items()))


def rhat(values: dict) -> float:
    return float(max(np.max(az.rhat(az.convert_to_dataset({k: v}))[k].values) for k, v in values.items()))


def nuts_reference(name, model, data, select, budget, cache: Path | None) -> tuple[dict, float]:
    """NUTS's compared quantities (``{name: [chains, draws, k]}``) and its wall time; with ``cache``, read
    from ``cache/<name>-<budget>-<data fingerprint>.npz`` when there (NUTS does not depend on this
    package: the reference of an unchanged model, budget and data can be reused), else written there."""
    # the data's fingerprint in the name: a reference is reused only for the very same data
    parts = (t.numpy().tobytes() if torch.is_tensor(t) else repr(t).encode() for t in data)
    fingerprint = hashlib.sha256(b"".join(parts)).hexdigest()[:12]
    path = None if cache is None else cache / f"{name}-{'-'.join(map(str, budget))}-{fingerprint}.npz"
    if path is not None and path.exists():
        stored = dict(np.load(path))
        return {k[2:]: v for k, v in stored.items() if k.startswith("q_")}, float(stored["seconds"])
    pyro.set_rng_seed(1)
    # the network's posterior makes NUTS build its deepest trees (1023 steps, ~1 s per draw): capped
    kernel = NUTS(model, max_tree_depth=6) if name == "bnn" else NUTS(model)
    nuts, seconds = timed_run(kernel, data, *budget)
    reference = quantities(nuts, select)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, seconds=seconds, **{f"q_{k}": v for k, v in reference.items()})
    return reference, seconds


def budgets(name: str, quick: bool) -> dict:
    """``(warm-up, draws, chains)`` of NUTS and of the kernels, and the kernels' thinning (``None``:
    automatic), for model ``name``.

    The network's posterior mixes slowly for every sampler: at the common budget NUTS reaches an ESS of
    about 27, so the errors would measure Monte Carlo error alone. There NUTS gets two chains of 3000 draws
    (about 25 minutes, ESS 264) and the kernels four chains of 5000 draws thinned by 1500 (8.25 million
    iterations each, warm-up included, at the step its pilot run chooses there), as the end-of-run checks
    advise (more iterations per draw). The table's network rows were run when that step was set for the
    largest stiffness the pilot met, 12 times smaller than the one set at Laplace draws alone; it is now set
    for their root mean square, 3.6 times larger, and those rows have not been run again since.
    """
    if quick:
        return {"nuts": (100, 100, 2), "kernels": (50, 100, 2), "thinning": None}
    if name == "bnn":
        return {"nuts": (500, 3000, 2), "kernels": (500, 5000, 4), "thinning": 1500}
    return {"nuts": (500, 1000, 2), "kernels": (500, 1000, 4), "thinning": None}


def timed_run(kernel, args, warmup, samples, chains) -> tuple[MCMC, float]:
    mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # divergence warnings are reported in the table
        mcmc.run(*args)
    return mcmc, time.perf_counter() - start


def compare(values, reference) -> dict:
    """The largest errors, and every quantity's (mean difference in NUTS sds, sd ratio to NUTS's)."""
    mean_errors, sd_ratios = {}, {}
    for k, v in values.items():
        ref = reference[k].reshape(-1, reference[k].shape[-1])
        flat = v.reshape(-1, v.shape[-1])
        ref_sd = ref.std(0)
        mean_errors[k] = ((flat.mean(0) - ref.mean(0)) / ref_sd).tolist()
        sd_ratios[k] = (flat.std(0) / ref_sd).tolist()
    return {
        "mean_err": max(abs(e) for errors in mean_errors.values() for e in errors),
        "sd_err": max(abs(r - 1) for ratios in sd_ratios.values() for r in ratios),
        "mean_errors": mean_errors,
        "sd_ratios": sd_ratios,
    }


def isotropic_step(kernel) -> float:
    """0.2 b / lambda_max of the pooled Hessian at the mode the default kernel found (benchmark only)."""
    pot = kernel.potential
    hessian = torch.autograd.functional.hessian(pot.potential, kernel.adaptation.mode)
    return 0.2 * pot.num_clients / float(torch.linalg.eigvalsh(hessian).max())


def run_kernel(name: str, problem: Problem, budget: dict):
    """The kernel ``name`` at its defaults on ``problem`` (with the budget's thinning, where it sets one):
    the run, its seconds and the kernel."""
    kernel = KERNELS[name](problem.model, problem.clients)
    if budget["thinning"] is not None:
        kernel.thinning = budget["thinning"]
    pyro.set_rng_seed(2)
    run, seconds = timed_run(kernel, problem.data, *budget["kernels"])
    return run, seconds, kernel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer draws: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument(
        "--nuts-cache", type=Path, help="a folder to keep and reuse NUTS references in (default: none)"
    )
    parser.add_argument(
        "--models", nargs="+", help="run only these (their rows replace those already in the results)"
    )
    parser.add_argument("--kernels", nargs="+", help=f"run only these of {list(KERNELS)}")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    problems = make_problems()
    for option, known in (("models", problems), ("kernels", KERNELS)):
        unknown = set(getattr(args, option) or ()) - set(known)
        if unknown:
            parser.error(f"--{option}: unknown {sorted(unknown)}; there are {list(known)}")
    rows = []
    for name, problem in problems.items():
        if args.models and name not in args.models:
            continue
        budget = budgets(name, args.quick)
        reference, nuts_seconds = nuts_reference(
            name, problem.model, problem.data, problem.select, budget["nuts"], args.nuts_cache
        )
        for kernel_name in KERNELS:
            if args.kernels and kernel_name not in args.kernels:
                continue
            run, seconds, kernel = run_kernel(kernel_name, problem, budget)
            values = quantities(run, problem.select)
            diagnostics = run.diagnostics()
            chosen = kernel.adaptation
            row = {
                "model": name,
                "kernel": kernel_name,
                "d": kernel.potential.dim,
                "clients": kernel.potential.num_clients,
                **compare(values, reference),
                "ess": ess(values),
                "nuts_ess": ess(reference),
                "rhat": rhat(values),
                "nuts_rhat": rhat(reference),
                "iterations": math.prod(budget["kernels"][1:]) * kernel.current_thinning,
                "nuts_draws": budget["nuts"][2] * budget["nuts"][1],
                "seconds": seconds,
                "nuts_seconds": nuts_seconds,
                "step_size": kernel.current_step_size,
                "batch_size": kernel.current_batch_size,
                "thinning": kernel.current_thinning,
                "preconditioner": "dense" if chosen.preconditioner.dim() == 2 else "diagonal",
                "condition": chosen.condition,
                "divergences": sum(len(v) for v in diagnostics["divergences"].values()),
                "problems": kernel.end_of_run_checks["problems"],
            }
            row["ess_per_s"] = row["ess"] / seconds
            row["nuts_ess_per_s"] = row["nuts_ess"] / nuts_seconds
            row["passes"] = row["mean_err"] <= MEAN_TARGET and row["sd_err"] <= SD_TARGET
            row["run"] = time.strftime("%Y-%m-%d", time.gmtime())  # when: rows of other runs may be kept
            if name == "scales_100x" and kernel_name == "FALD":
                row["isotropic"] = other_step(problem, reference, budget, isotropic_step(kernel))
            rows.append(row)
            print(json.dumps(row), flush=True)
    write(rows, args, list(problems))


def other_step(problem: Problem, reference, budget, step: float) -> dict:
    """The errors and ESS of the same FALD run with the given ``step`` (no preconditioner)."""
    pyro.set_rng_seed(2)
    kernel = FaldKernel(problem.model, problem.clients, step_size=step, thinning=budget["thinning"])
    run, _ = timed_run(kernel, problem.data, *budget["kernels"])
    values = quantities(run, problem.select)
    return {**compare(values, reference), "ess": ess(values), "step_size": step}


def _runs(rows: list[dict]) -> list[str]:
    """A paragraph naming which models' rows come from which run, where they come from several (``--models``
    keeps the other rows): each row and its NUTS reference are of one run, at that run's code."""
    dates: dict[str, list[str]] = {}
    for r in rows:
        models = dates.setdefault(r.get("run", "an earlier run"), [])
        if r["model"] not in models:
            models.append(r["model"])
    if len(dates) == 1:
        return []
    parts = [f"{', '.join(f'`{m}`' for m in models)}: {run}" for run, models in sorted(dates.items())]
    return [
        "Rows from several runs (each row and its NUTS reference from one run, at that run's code): "
        + "; ".join(parts)
        + ".",
        "",
    ]


def write(rows: list[dict], args, order: list[str]) -> None:
    """The results files; with ``--models`` or ``--kernels``, the rows already there of the others are kept
    (in ``order``, the models' names, then the kernels')."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "defaults_quick" if args.quick else "defaults"
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }
    path = args.out / f"{stem}.json"
    if (args.models or args.kernels) and path.exists():
        new = {(r["model"], r["kernel"]) for r in rows}
        # rows of the others, of a kernel of this benchmark (rows written before it had kernels are dropped)
        kept = [
            r
            for r in json.loads(path.read_text())["rows"]
            if r.get("kernel") in KERNELS and r["model"] in order and (r["model"], r["kernel"]) not in new
        ]
        kernels = list(KERNELS)
        rows = sorted(
            kept + rows, key=lambda r: (order.index(r["model"]), kernels.index(r.get("kernel", "")))
        )
    path.write_text(json.dumps({"rows": rows, "info": info}, indent=2))
    lines = [
        "# Every kernel at its defaults vs NUTS on the pooled data",
        "",
        f"Written by `benchmarks/defaults.py{' --quick' if args.quick else ''}` (see its docstring). "
        f"Targets: mean err ≤ {MEAN_TARGET}, sd err ≤ {SD_TARGET}; ESS/s at least NUTS's but on `bnn`. "
        f"{info}",
        "",
        *_runs(rows),
        "| model | kernel | d | clients | mean err | sd err | MC sd | passes | ESS | R-hat | s | ESS/s "
        "| NUTS ESS | NUTS R-hat | NUTS s | NUTS ESS/s | ESS/s ratio | step | batch | thinning "
        "| preconditioner (κ diagonal) | divergences | end-of-run checks |",
        "|---|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        cells = [
            r["model"],
            r["kernel"],
            r["d"],
            r["clients"],
            f"{r['mean_err']:.3f}",
            f"{r['sd_err']:.3f}",
            f"{math.sqrt(1 / r['ess'] + 1 / r['nuts_ess']):.3f}",
            "yes" if r["passes"] else "NO",
            f"{r['ess']:.0f}",
            f"{r['rhat']:.3f}",
            f"{r['seconds']:.1f}",
            f"{r['ess_per_s']:.3g}",
            f"{r['nuts_ess']:.0f}",
            f"{r['nuts_rhat']:.3f}",
            f"{r['nuts_seconds']:.1f}",
            f"{r['nuts_ess_per_s']:.3g}",
            f"{r['ess_per_s'] / r['nuts_ess_per_s']:.2f}",
            f"{r['step_size']:.3g}",
            r["batch_size"] or "full",
            r["thinning"],
            f"{r['preconditioner']} ({r['condition']:.3g})",
            r["divergences"],
            "silent"
            if not r["problems"]
            else "warned: " + "; ".join(p.split(" (")[0] for p in r["problems"]),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for r in rows:
        if r["nuts_ess"] < 100 and r["kernel"] == "FALD":
            lines += [
                "",
                f"`{r['model']}`: NUTS's own ESS is {r['nuts_ess']:.0f}: the reference is not converged "
                "either, so its rows' errors measure Monte Carlo error more than bias.",
            ]
        if r["ess"] < 100:
            mc_sd = math.sqrt(1 / r["ess"] + 1 / r["nuts_ess"])
            lines += [
                "",
                f"`{r['model']}`, {r['kernel']}: ESS {r['ess']:.0f} (R-hat {r['rhat']:.3f}), so one "
                f"quantity's mean err has a Monte Carlo sd of {mc_sd:.2f}: a coarser check than the other "
                "rows'.",
            ]
        if r["model"] == "bnn":
            grid = ", ".join(f"{x:.2f}" for x in BNN_GRID.tolist())
            ratios = ", ".join(f"{x:.2f}" for x in r["sd_ratios"]["f"])
            lines += [
                "",
                f"`bnn`, {r['kernel']}: sd / NUTS's of f at the inputs {grid} (the data lie in [-2, 2]): "
                f"{ratios}.",
            ]
        if "isotropic" in r:
            i = r["isotropic"]
            lines += [
                "",
                f"`scales_100x`, FALD with the best isotropic step ({i['step_size']:.3g}, no "
                f"preconditioner): mean err {i['mean_err']:.3g}, sd err {i['sd_err']:.3g}, ESS "
                f"{i['ess']:.0f} — against {r['mean_err']:.3f}, {r['sd_err']:.3f} and {r['ess']:.0f} with "
                "the defaults.",
            ]
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
