"""Models written as Pyro's NUTS tutorials write them, sampled by the kernels at their defaults beside NUTS.

What is measured
----------------
Five models, each written as a NUTS user writes it (no ``pyro.subsample``: the data are the model's
arguments, read at full size), sampled by ``FaldKernel(model, 10)``, ``VrFaldKernel(model, 10)`` and
``QlsdKernel(model, 10)`` at their defaults (10 i.i.d. clients) and by Pyro's ``NUTS`` on the same model and
the pooled data:

- ``regression tutorial``: the shape of Pyro's "Bayesian regression" tutorial, ``mean = a + b_a * africa +
  b_r * rugged + b_ar * africa * rugged`` computed before the plate, ``sigma ~ Uniform(0, 10)``, ``obs`` at
  full size (170 synthetic countries of the tutorial's sizes; no download);
- ``logits before the plate``: Titanic survival (``pyro_fed.datasets.titanic``), ``obs=y``;
- ``optional obs (Poisson)``: a Poisson regression ``model(x, counts=None)``, the rate at full size (500
  synthetic points, 3 covariates);
- ``PyroModule network``: the regression tutorial's ``PyroModule[nn.Linear]`` with ``PyroSample`` weights,
  on the same countries;
- ``keyword covariates``: Titanic's logistic regression with ``class_=``, ``sex=``, ``age=`` and ``y=``
  passed by keyword.

Each sampler runs ``--chains`` chains of ``--warmup`` + ``--samples`` (NUTS's chains one after the other),
float64, one thread. The kernels' draws are compared with NUTS's, per coordinate of every latent site: the
mean's distance in NUTS sds, the sd ratio farthest from 1, the largest R-hat and the smallest bulk ESS
(ArviZ). A kernel passes a model when every mean is within 0.2 NUTS sd, every sd within 15% and every
R-hat at most 1.05 (the issue's targets; the Monte Carlo error of the comparison, at these ESS, is about
0.03 sd and 2%).

Run::

    python benchmarks/nuts_models.py           # 4 chains x (500 + 1000), a few minutes
    python benchmarks/nuts_models.py --quick   # smoke run
    python benchmarks/nuts_models.py --models "optional obs (Poisson)" --quick

Results: ``benchmarks/results/nuts_models{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS
from pyro.nn import PyroModule, PyroSample

import pyro_fed

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = {"FALD": pyro_fed.FaldKernel, "VR-FALD*": pyro_fed.VrFaldKernel, "QLSD": pyro_fed.QlsdKernel}
MEAN_TARGET, SD_TARGET, RHAT_TARGET = 0.2, 0.15, 1.05


# ---------------------------------------------------------------------------------------------- models
def regression_tutorial(is_cont_africa, ruggedness, log_gdp=None):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b_a = pyro.sample("bA", dist.Normal(0.0, 1.0))
    b_r = pyro.sample("bR", dist.Normal(0.0, 1.0))
    b_ar = pyro.sample("bAR", dist.Normal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
    mean = a + b_a * is_cont_africa + b_r * ruggedness + b_ar * is_cont_africa * ruggedness
    with pyro.plate("data", len(ruggedness)):
        pyro.sample("obs", dist.Normal(mean, sigma), obs=log_gdp)


def logistic(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def poisson(x, counts=None):
    intercept = pyro.sample("intercept", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    rate = torch.exp(intercept + x @ b)
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Poisson(rate), obs=counts)


class BayesianRegression(PyroModule):
    """The regression tutorial's network: one linear layer, its weights sampled."""

    def __init__(self, in_features: int = 3):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](in_features, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, in_features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def keyword_logistic(*, class_, sex, age, y=None):
    intercept = pyro.sample("intercept", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    logits = intercept + b[0] * class_ + b[1] * sex + b[2] * age
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


# ------------------------------------------------------------------------------------------------ data
def countries(seed: int = 0):
    """170 synthetic countries of the regression tutorial's shape: ``(africa, ruggedness, log_gdp)``."""
    g = torch.Generator().manual_seed(seed)
    africa = (torch.rand(170, generator=g) < 0.3).double()
    rugged = torch.rand(170, generator=g).double() * 6.0
    log_gdp = 9.2 - 1.9 * africa - 0.2 * rugged + 0.35 * africa * rugged + 0.9 * torch.randn(170, generator=g)
    return africa, rugged, log_gdp.double()


def counts_data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(500, 3, generator=g, dtype=torch.float64)
    rate = torch.exp(0.5 + x @ torch.tensor([0.4, -0.3, 0.2], dtype=torch.float64))
    return x, torch.poisson(rate, generator=g)


def problems() -> dict:
    """``{name: (model, args, kwargs)}``."""
    x, y = pyro_fed.datasets.titanic(torch.float64)
    africa, rugged, log_gdp = countries()
    features = torch.stack([africa, rugged, africa * rugged], -1)
    counts_x, counts = counts_data()
    return {
        "regression tutorial": (regression_tutorial, (africa, rugged, log_gdp), {}),
        "logits before the plate": (logistic, (x, y), {}),
        "optional obs (Poisson)": (poisson, (counts_x,), {"counts": counts}),
        "PyroModule network": (BayesianRegression(), (features, log_gdp), {}),
        "keyword covariates": (
            keyword_logistic,
            (),
            {"class_": x[:, 1], "sex": x[:, 2], "age": x[:, 3], "y": y},
        ),
    }


# -------------------------------------------------------------------------------------------- sampling
def flat_draws(samples: dict[str, torch.Tensor], chains: int) -> dict[str, np.ndarray]:
    """``{coordinate: [chains, draws]}`` of every latent site's coordinates."""
    out = {}
    for name, value in samples.items():
        value = value.reshape(chains, value.shape[0] // chains, -1)
        for j in range(value.shape[-1]):
            out[f"{name}[{j}]" if value.shape[-1] > 1 else name] = value[..., j].numpy()
    return out


def run_nuts(model, args, kwargs, chains, warmup, samples, seed) -> tuple[dict, float]:
    runs, seconds = [], 0.0
    for chain in range(chains):
        pyro.set_rng_seed(seed + chain)
        mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=warmup, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(*args, **kwargs)
        seconds += time.perf_counter() - start
        runs.append(mcmc.get_samples())
    draws = {k: torch.cat([r[k] for r in runs]) for k in runs[0]}
    return flat_draws(draws, chains), seconds


def run_kernel(kernel_class, model, args, kwargs, chains, warmup, samples, seed) -> tuple[dict, float, bool]:
    kernel = kernel_class(model, 10)
    mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True)
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    with warnings.catch_warnings():  # the end-of-run checks' verdicts are in the comparison's R-hat and ESS
        warnings.simplefilter("ignore")
        mcmc.run(*args, **kwargs)
    seconds = time.perf_counter() - start
    return flat_draws(mcmc.get_samples(), chains), seconds, kernel.potential.sites.rows is not None


def compare(draws: dict, reference: dict) -> dict:
    mean_err = max(abs(draws[k].mean() - reference[k].mean()) / reference[k].std() for k in reference)
    ratios = {k: draws[k].std() / reference[k].std() for k in reference}
    sd_ratio = max(ratios.values(), key=lambda r: abs(r - 1))
    data = az.convert_to_dataset(dict(draws))
    rhat = float(max(az.rhat(data)[k].item() for k in draws))
    ess = float(min(az.ess(data)[k].item() for k in draws))
    passes = bool(mean_err <= MEAN_TARGET and abs(sd_ratio - 1) <= SD_TARGET and rhat <= RHAT_TARGET)
    return {
        "mean_err": float(mean_err),
        "sd_ratio": float(sd_ratio),
        "rhat": rhat,
        "ess": ess,
        "passes": passes,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 x (50 + 100)")
    parser.add_argument("--models", help="comma-separated names of the models to run (default: all)")
    parser.add_argument("--chains", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chains, warmup, samples = (
        given or size
        for given, size in zip(
            (args.chains, args.warmup, args.samples),
            (2, 50, 100) if args.quick else (4, 500, 1000),
            strict=True,
        )
    )
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    rows, started = [], time.perf_counter()
    try:
        chosen = problems()
        if args.models:
            chosen = {name: chosen[name] for name in args.models.split(",")}
        for name, (model, model_args, model_kwargs) in chosen.items():
            reference, nuts_seconds = run_nuts(
                model, model_args, model_kwargs, chains, warmup, samples, args.seed
            )
            nuts = {
                "model": name,
                "sampler": "NUTS",
                "seconds": nuts_seconds,
                **compare(reference, reference),
            }
            nuts["ess_per_s"] = nuts["ess"] / nuts_seconds
            rows.append(nuts)
            for sampler, kernel_class in KERNELS.items():
                draws, seconds, by_rows = run_kernel(
                    kernel_class, model, model_args, model_kwargs, chains, warmup, samples, args.seed
                )
                row = {"model": name, "sampler": sampler, "seconds": seconds, "by_rows": by_rows}
                row.update(compare(draws, reference))
                row["ess_per_s"] = row["ess"] / seconds
                row["ess_per_s_ratio"] = row["ess_per_s"] / nuts["ess_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    stem = "nuts_models_quick" if args.quick else "nuts_models"
    info = {
        "chains": chains,
        "warmup": warmup,
        "samples": samples,
        "seed": args.seed,
        "wall_seconds": time.perf_counter() - started,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"rows": rows, "info": info}, indent=1) + "\n")
    text = table(rows, info)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return rows


def table(rows: list[dict], info: dict) -> str:
    kernels = [r for r in rows if r["sampler"] != "NUTS"]
    lines = [
        "# Models written for NUTS, under the kernels at their defaults",
        "",
        f"Each model as a NUTS user writes it (its data read at full size), {info['chains']} chains × "
        f"({info['warmup']} warm-up + {info['samples']} draws), float64, one thread; the kernels on 10 "
        "i.i.d. clients, compared with Pyro's NUTS on the same model and the pooled data (NUTS's chains one "
        f"after the other). Passes: every mean within {MEAN_TARGET} NUTS sd, every sd within "
        f"{SD_TARGET:.0%}, every R-hat ≤ {RHAT_TARGET}. {sum(r['passes'] for r in kernels)} of "
        f"{len(kernels)} kernel runs pass; {sum(r['by_rows'] for r in kernels)} of them ran the model on "
        "its clients' rows. "
        f"Written in {info['wall_seconds']:.0f} s (Python {info['python']}, torch {info['torch']}, pyro "
        f"{info['pyro']}).",
        "",
        "| model | sampler | passes | mean err (NUTS sd) | sd ratio | R-hat | min ESS | s | ESS/s | ×NUTS |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['ess_per_s_ratio']:.2f}" if "ess_per_s_ratio" in r else ""
        passes = "" if r["sampler"] == "NUTS" else ("yes" if r["passes"] else "**no**")
        lines.append(
            f"| {r['model']} | {r['sampler']} | {passes} | {r['mean_err']:.3f} | {r['sd_ratio']:.3f} | "
            f"{r['rhat']:.3f} | {r['ess']:.0f} | {r['seconds']:.1f} | {r['ess_per_s']:.0f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
