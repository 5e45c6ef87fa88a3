r"""``MCMC(FaldKernel(model))`` with every default, against NUTS on the pooled data, on models written the
way Pyro users write them.

What is measured
----------------
Seven models, each with its data made here from a fixed seed (Titanic: the table shipped with the package):

- ``regression``: linear regression, 4 standardised features, a ``HalfNormal`` noise scale (``N = 1000``);
- ``poisson``: a Poisson GLM with a log link, 3 features (``N = 1000``);
- ``student_t``: a Student-t likelihood whose degrees of freedom are learned (``Gamma(2, 0.1)`` prior),
  with its scale, on heavy-tailed data (``N = 1000``): the posterior's curvatures span two orders;
- ``bnn``: a ``PyroModule`` network, one input, 3 ``tanh`` units, a learned noise scale (``N = 200``);
  its weights are not identifiable (the units can be permuted and their signs flipped), so what is
  compared is the regression function :math:`f(x)` at 8 inputs, the noise scale, and nothing else;
- ``mvn_lkj``: a 3-dimensional normal with unknown mean, ``HalfNormal`` scales and an ``LKJCholesky(3, 2)``
  correlation prior (``N = 500``); compared on the mean, the scales and the three free entries of the
  Cholesky factor;
- ``titanic``: the README's logistic regression on the Titanic table (2201 people);
- ``scales_100x``: a linear regression whose features have scales 1, 10 and 0.1, so that its posterior
  sds differ by 100x (``N = 500``, known noise).

For each model, Pyro's NUTS on the pooled data (two chains, 500 warm-up + 1000 draws each; on ``bnn``
with ``max_tree_depth=6``, as its default depth of 10 costs about a second per draw) is the reference, and
``MCMC(FaldKernel(model), num_samples=5000, warmup_steps=500, num_chains=2)`` — no clients (10 i.i.d.), no
step size, no preconditioner given — is compared with it. The network's posterior mixes slowly for both
samplers, so on ``bnn`` both run longer (see :func:`budgets`): NUTS two chains of 3000 draws, FALD four
chains of 5000 draws thinned by 1500 (``thinning=1500``). Per compared quantity :math:`j`:

- ``mean err`` = :math:`\max_j |\hat\mu_j - \mu^{NUTS}_j| / \sigma^{NUTS}_j` (target ≤ 0.2);
- ``sd err`` = :math:`\max_j |\hat\sigma_j / \sigma^{NUTS}_j - 1|` (target ≤ 0.15);
- ``ESS/s``: the min over quantities of ArviZ's bulk ESS, divided by the wall time of ``mcmc.run``
  (warm-up, adaptation, tracing and compilation included; all chains of the run pooled);
- ``preconditioner``: the form the warm-up chose, with the condition number :math:`\kappa` the diagonal
  one leaves (the dense one is taken above 4, see :mod:`pyro_fed.algorithms.adaptation`).

Both errors include the Monte Carlo error of both runs (the table prints both ESS: with ESS :math:`E`, a
mean has standard error :math:`\sigma/\sqrt E` and an sd about :math:`1/\sqrt{2E}` relative), so a run
passes only with enough effective draws: ``MC sd`` is :math:`\sqrt{1/E_{FALD} + 1/E_{NUTS}}`, the standard
deviation of one quantity's ``mean err`` from Monte Carlo error alone (the max over quantities is larger),
and ``R-hat`` the largest rank-normalised split R-hat over the quantities (ArviZ's).

On ``bnn`` the sd ratios of :math:`f` are printed per input, inside and outside the data's range.

On ``scales_100x`` the same FALD with the best *isotropic* step of the same stability
(:math:`\gamma = 0.2\, b / \lambda_{\max}(\nabla^2 U)`, no preconditioner, the pooled Hessian used to set
it) is run too: its widest coordinate moves 10^4 times slower.

Run::

    python benchmarks/defaults.py            # all models (about 75 minutes on one core, most of it on
                                             # the network: NUTS 25 minutes, FALD 27)
    python benchmarks/defaults.py --models bnn titanic   # these rows only (the others in the results kept)
    python benchmarks/defaults.py --quick    # fewer draws, a smoke run (a few minutes)

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
from pathlib import Path

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


def make_problems() -> dict:
    g = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    problems = {}
    x = normal(1000, 4)
    problems["regression"] = (
        regression,
        (x, x @ torch.tensor([0.5, -1.0, 0.0, 2.0]) + 0.7 * normal(1000)),
        None,
    )
    x = torch.cat([torch.ones(1000, 1), 0.5 * normal(1000, 2)], 1)
    problems["poisson"] = (
        poisson,
        (x, torch.poisson((x @ torch.tensor([1.0, 0.5, -0.3])).exp(), generator=g)),
        None,
    )
    x = torch.cat([torch.ones(1000, 1), normal(1000, 2)], 1)
    # Student-t(4) noise, a normal over the root of a chi-square(4) / 4, from its own seeded generator (the
    # other models' data stay those of earlier runs)
    t = torch.Generator().manual_seed(1)
    noise = torch.randn(1000, generator=t) / torch.randn(1000, 4, generator=t).square().mean(-1).sqrt()
    problems["student_t"] = (student_t, (x, x @ torch.tensor([0.3, 1.0, -0.5]) + 0.5 * noise), None)
    x = 2.0 * torch.rand(200, 1, generator=g) - 1.0
    y = torch.sin(2.0 * x[:, 0]) + 0.2 * normal(200)
    problems["bnn"] = (Network(), (x * 2.0, y), bnn_quantities)
    correlation = torch.tensor([[1.0, 0.6, -0.3], [0.6, 1.0, 0.2], [-0.3, 0.2, 1.0]])
    scale_tril = torch.linalg.cholesky(correlation) * torch.tensor([1.0, 2.0, 0.5])[:, None]
    problems["mvn_lkj"] = (
        mvn_lkj,
        (torch.tensor([1.0, -2.0, 0.5]) + normal(500, 3) @ scale_tril.T,),
        lkj_quantities,
    )
    problems["titanic"] = (logistic_regression, pyro_fed.datasets.titanic(), None)
    x = normal(500, 3) * torch.tensor([1.0, 10.0, 0.1])
    problems["scales_100x"] = (
        known_noise_regression,
        (x, x @ torch.tensor([1.0, -0.1, 5.0]) + 0.5 * normal(500)),
        None,
    )
    return problems


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
    fingerprint = hashlib.sha256(b"".join(t.numpy().tobytes() for t in data)).hexdigest()[:12]
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
    """``(warm-up, draws, chains)`` of NUTS and of FALD, and FALD's thinning, for model ``name``.

    The network's posterior mixes slowly for both samplers: at the common budget NUTS reaches an ESS of
    about 27 and FALD about 5, so the errors would measure Monte Carlo error alone. There NUTS gets two
    chains of 3000 draws (about 25 minutes, ESS 264) and FALD four chains of 5000 draws thinned by 1500
    (8.25 million iterations each, warm-up included; about 27 minutes beside other jobs, ESS 55: the
    step its pilot run chooses there is 12 times smaller than the one set at Laplace draws alone).
    ``thinning`` only spaces out the draws that ``MCMC`` stores; the iterations are the same.
    """
    if quick:
        return {"nuts": (100, 100, 2), "fald": (100, 400, 2), "thinning": 1}
    if name == "bnn":
        return {"nuts": (500, 3000, 2), "fald": (500, 5000, 4), "thinning": 1500}
    return {"nuts": (500, 1000, 2), "fald": (500, 5000, 2), "thinning": 1}


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


def isotropic_step(model, args, kernel) -> float:
    """0.2 b / lambda_max of the pooled Hessian at the mode the default kernel found (benchmark only)."""
    pot = kernel.potential
    hessian = torch.autograd.functional.hessian(pot.potential, kernel.adaptation.mode)
    return 0.2 * pot.num_clients / float(torch.linalg.eigvalsh(hessian).max())


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
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    problems = make_problems()
    unknown = set(args.models or ()) - set(problems)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; the models are {list(problems)}")
    rows = []
    for name, (model, data, select) in problems.items():
        if args.models and name not in args.models:
            continue
        budget = budgets(name, args.quick)
        reference, nuts_seconds = nuts_reference(name, model, data, select, budget["nuts"], args.nuts_cache)
        pyro.set_rng_seed(2)
        kernel = FaldKernel(model, thinning=budget["thinning"])
        fald, fald_seconds = timed_run(kernel, data, *budget["fald"])
        values = quantities(fald, select)
        divergences = sum(len(v) for v in fald.diagnostics()["divergences"].values())
        row = {
            "model": name,
            "d": kernel.potential.dim,
            **compare(values, reference),
            "fald_ess": ess(values),
            "nuts_ess": ess(reference),
            "fald_rhat": rhat(values),
            "nuts_rhat": rhat(reference),
            "fald_iterations": math.prod(budget["fald"][1:]) * budget["thinning"],
            "nuts_draws": budget["nuts"][2] * budget["nuts"][1],
            "fald_seconds": fald_seconds,
            "nuts_seconds": nuts_seconds,
            "step_size": kernel.adaptation.step_size,
            "preconditioner": "dense" if kernel.adaptation.preconditioner.dim() == 2 else "diagonal",
            "condition": kernel.adaptation.condition,
            "curvature_span": float(
                kernel.adaptation.curvature.abs().max() / kernel.adaptation.curvature.abs().min()
            ),
            "divergences": divergences,
        }
        row["fald_ess_per_s"] = row["fald_ess"] / fald_seconds
        row["nuts_ess_per_s"] = row["nuts_ess"] / nuts_seconds
        row["passes"] = row["mean_err"] <= MEAN_TARGET and row["sd_err"] <= SD_TARGET
        if name == "scales_100x":
            step = isotropic_step(model, data, kernel)
            row["isotropic"] = other_step(model, data, select, reference, budget, step)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args, list(problems))


def other_step(model, data, select, reference, budget, step: float) -> dict:
    """The errors and ESS of the same FALD run with the given ``step`` (no preconditioner)."""
    pyro.set_rng_seed(2)
    kernel = FaldKernel(model, step_size=step, thinning=budget["thinning"])
    run, _ = timed_run(kernel, data, *budget["fald"])
    values = quantities(run, select)
    return {**compare(values, reference), "ess": ess(values), "step_size": step}


def write(rows: list[dict], args, order: list[str]) -> None:
    """The results files; with ``--models``, the rows already there of the other models are kept (the rows
    in ``order``, the models' names)."""
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
    if args.models and path.exists():
        kept = [r for r in json.loads(path.read_text())["rows"] if r["model"] not in args.models]
        rows = sorted(kept + rows, key=lambda r: order.index(r["model"]))
    path.write_text(json.dumps({"rows": rows, "info": info}, indent=2))
    lines = [
        "# `MCMC(FaldKernel(model))` with every default vs NUTS on the pooled data",
        "",
        f"Written by `benchmarks/defaults.py{' --quick' if args.quick else ''}` (see its docstring). "
        f"Targets: mean err ≤ {MEAN_TARGET}, sd err ≤ {SD_TARGET}. {info}",
        "",
        "| model | d | mean err | sd err | MC sd | passes | FALD ESS | R-hat | FALD s | FALD ESS/s "
        "| NUTS ESS | R-hat | NUTS s | NUTS ESS/s | ESS/s ratio | step | preconditioner (κ diagonal) "
        "| curvature span | divergences |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        cells = [
            r["model"],
            r["d"],
            f"{r['mean_err']:.3f}",
            f"{r['sd_err']:.3f}",
            f"{math.sqrt(1 / r['fald_ess'] + 1 / r['nuts_ess']):.3f}",
            "yes" if r["passes"] else "NO",
            f"{r['fald_ess']:.0f}",
            f"{r['fald_rhat']:.3f}",
            f"{r['fald_seconds']:.1f}",
            f"{r['fald_ess_per_s']:.3g}",
            f"{r['nuts_ess']:.0f}",
            f"{r['nuts_rhat']:.3f}",
            f"{r['nuts_seconds']:.1f}",
            f"{r['nuts_ess_per_s']:.3g}",
            f"{r['fald_ess_per_s'] / r['nuts_ess_per_s']:.2f}",
            f"{r['step_size']:.3g}",
            f"{r['preconditioner']} ({r['condition']:.3g})",
            f"{r['curvature_span']:.3g}",
            r["divergences"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for r in rows:
        if r["nuts_ess"] < 100:
            lines += [
                "",
                f"`{r['model']}`: NUTS's own ESS is {r['nuts_ess']:.0f} (FALD's {r['fald_ess']:.0f}): the "
                "reference is not converged either, so this row's errors measure both samplers' Monte Carlo "
                "error more than FALD's bias.",
            ]
        if r["fald_ess"] < 100:
            mc_sd = math.sqrt(1 / r["fald_ess"] + 1 / r["nuts_ess"])
            lines += [
                "",
                f"`{r['model']}`: FALD's ESS is {r['fald_ess']:.0f} (R-hat {r['fald_rhat']:.3f}), so one "
                f"quantity's mean err has a Monte Carlo sd of {mc_sd:.2f}: "
                "the row shows no bias beyond that, a coarser check than the other rows'.",
            ]
        if r["model"] == "bnn":
            grid = ", ".join(f"{x:.2f}" for x in BNN_GRID.tolist())
            ratios = ", ".join(f"{x:.2f}" for x in r["sd_ratios"]["f"])
            lines += [
                "",
                f"`bnn`: FALD's sd / NUTS's of f at the inputs {grid} (the data lie in [-2, 2]): {ratios}.",
            ]
        if "isotropic" in r:
            i = r["isotropic"]
            lines += [
                "",
                f"`scales_100x` with the best isotropic step ({i['step_size']:.3g}, no preconditioner): "
                f"mean err {i['mean_err']:.3g}, sd err {i['sd_err']:.3g}, ESS {i['ess']:.0f} — against "
                f"{r['mean_err']:.3f}, {r['sd_err']:.3f} and {r['fald_ess']:.0f} with the defaults.",
            ]
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
