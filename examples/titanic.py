"""Titanic survival, sampled without pooling the data: federated Langevin (FALD) vs. NUTS.

The 2201 people aboard the Titanic are spread over 10 "sites" (clients) that may not share their rows. Each
site knows who survived among *its* passengers, and the sites are very different from one another: a
Dirichlet label-skewed split, in which 91% of one site's people survived and 9% of another's. We want the
posterior of a Bayesian logistic regression of survival on class, sex and age, as if the data were pooled.

``pyro_fed.FaldKernel`` runs Federated Averaging Langevin Dynamics (FALD): every client takes Langevin
steps on its own data (minibatches of 64), and now and then (with probability ``comm_prob`` per iteration)
the server averages the clients' parameter vectors. Only parameter vectors cross the network, never data.
It is a Pyro ``MCMCKernel``, so it runs under the ordinary ``pyro.infer.MCMC``, and
``pyro_fed.to_inference_data`` hands the result to ArviZ.

As the reference we run Pyro's NUTS on the pooled data (what we would do if pooling were allowed) and
report how far apart the two posteriors are, what FALD cost in communication, and the wall time of each.

Run it (about a minute on a 2-core laptop)::

    python examples/titanic.py                 # writes output/titanic/{posterior.png,summary.md}
    python examples/titanic.py --smoke         # a few seconds, tiny chains (used by the tests)

Reference: Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a unified
theory and new algorithms*, AISTATS 2023 (the Titanic experiment of Section 5).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import arviz as az
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS

import pyro_fed

matplotlib.use("Agg")  # write files only; never open a window

NUM_CLIENTS = 10
DIRICHLET_ALPHA = 0.5  # label skew of the split: small alpha, very different clients
BATCH_SIZE = 64  # minibatch per client and iteration
COMM_PROB = 0.5  # an averaging round every 2 iterations on average
NUM_CHAINS = 2
FEATURES = list(pyro_fed.datasets.feature_names)  # intercept, class, sex, age

# Label the weights by feature in ArviZ: w[intercept], w[class], ... instead of w[0], w[1], ...
COORDS = {"feature": FEATURES}
DIMS = {"w": ["feature"]}


def model(x, y=None):
    """Bayesian logistic regression, w ~ N(0, I), as written for Pyro's NUTS.

    The data plate is declared at full size and the data are the model's arguments: the federated kernel runs
    the model on each client's own rows of them (its minibatch), NUTS on all of them.
    """
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("output/titanic"), help="output folder")
    # FALD's iterations are small Langevin steps, cheap but strongly autocorrelated: its draws are thinned
    # automatically to about half an autocorrelation time apart, so that they are nearly independent, as
    # NUTS's are
    parser.add_argument("--num-samples", type=int, default=1000, help="FALD draws per chain")
    parser.add_argument("--nuts-samples", type=int, default=1000, help="NUTS draws per chain")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up iterations per chain (both)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny run (20 warm-up + 30 FALD, 100 NUTS draws), for tests"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_samples, args.nuts_samples, args.warmup = 30, 100, 20
    return args


def fald_kernel(clients) -> pyro_fed.FaldKernel:
    """FALD with the step size and preconditioner chosen automatically before the chains start, from
    what the clients can compute (the mode by L-BFGS, each client's curvature there, the minibatch noise):
    see ``pyro_fed.algorithms.adaptation``. No pooled data is needed to set it."""
    return pyro_fed.FaldKernel(
        model,
        clients,
        comm_prob=COMM_PROB,
        # all clients share one Gaussian noise, so they spread apart only through their gradients (the
        # client average receives the same noise whatever noise_corr is)
        noise_corr=1.0,
        batch_size=BATCH_SIZE,
    )


def run(kernel, x, y, num_samples: int, args) -> tuple[MCMC, float]:
    """Run ``NUM_CHAINS`` chains of ``kernel`` (FALD's start at independent draws of the Laplace
    approximation its adaptation found, so its warm-up is a short burn-in)."""
    mcmc = MCMC(
        kernel,
        num_samples=num_samples,
        warmup_steps=args.warmup,
        num_chains=NUM_CHAINS,
        disable_progbar=args.smoke,
    )
    start = time.perf_counter()
    mcmc.run(x, y)
    return mcmc, time.perf_counter() - start


def mean_distance(fald: az.InferenceData, nuts: az.InferenceData) -> np.ndarray:
    """Per weight, ``|mean_FALD - mean_NUTS| / sd_NUTS``: the gap in units of posterior sd."""
    w_fald = fald.posterior["w"].values.reshape(-1, len(FEATURES))
    w_nuts = nuts.posterior["w"].values.reshape(-1, len(FEATURES))
    return np.abs(w_fald.mean(0) - w_nuts.mean(0)) / w_nuts.std(0)


def communication(mcmc: MCMC) -> tuple[list[int], int]:
    """Averaging rounds per chain (warm-up included: those messages were sent too) and total uploaded
    bits (every client uploads its 4 floats of 32 bits per round)."""
    diagnostics = mcmc.diagnostics()
    rounds = list(diagnostics["communication rounds"].values())
    bits = sum(diagnostics["uploaded bits"].values())
    return rounds, bits


def plot_densities(fald: az.InferenceData, nuts: az.InferenceData, path: Path) -> None:
    """One panel per weight, the two posteriors overlaid (central 99% of each)."""
    axes = az.plot_density(
        [fald, nuts],
        data_labels=["FALD (10 clients)", "NUTS (pooled data)"],
        var_names=["w"],
        hdi_prob=0.99,
        shade=0.15,
        grid=(2, 2),
        figsize=(9, 6),
    )
    axes = np.ravel(axes)
    figure = axes[0].figure
    # one legend for the figure, below the panels, instead of ArviZ's inside the first panel
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    figure.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    figure.suptitle("Titanic logistic regression: posterior of the weights")
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report(fald_summary, nuts_summary, distance, rounds, bits, data_bits, times) -> str:
    """The results, printed to the terminal and written to summary.md (Markdown)."""
    distances = "\n".join(f"  w[{f}]: {d:.3f}" for f, d in zip(FEATURES, distance, strict=True))
    # Monte Carlo error of FALD's means in the same units: gaps well above it are FALD's own bias.
    noise = (fald_summary["mcse_mean"] / nuts_summary["sd"]).max()
    return f"""## FALD ({NUM_CLIENTS} clients, data never pooled)

```
{fald_summary.to_string()}
```

## NUTS (pooled data)

```
{nuts_summary.to_string()}
```

## Distance between the posterior means, in NUTS posterior sds

```
{distances}
  max distance: {distance.max():.3f} posterior sds
  (Monte Carlo error of the FALD means: up to {noise:.3f} posterior sds)
```

## Cost

```
FALD communication rounds per chain (warm-up included): {", ".join(map(str, rounds))}
FALD uploaded bits (all clients, all chains): {bits:,} ({bits / 8e6:.2f} MB)
  for scale, the raw data would be {data_bits / 8e6:.2f} MB: the point is that rows never leave a client
FALD wall time: {times["fald"]:.1f} s (sampling) + {times["fald_arviz"]:.1f} s (ArviZ conversion)
NUTS wall time: {times["nuts"]:.1f} s (sampling)
```
"""


def describe_setup(x, y, clients, args) -> str:
    sizes = torch.bincount(clients, minlength=NUM_CLIENTS)
    survival = torch.bincount(clients, weights=y.double(), minlength=NUM_CLIENTS) / sizes
    return (
        f"Data: {len(y)} people, {x.shape[1]} weights ({', '.join(FEATURES)}), prior N(0, 1).\n"
        f"Clients: {NUM_CLIENTS}, Dirichlet(alpha={DIRICHLET_ALPHA}) label skew; sizes {sizes.tolist()},\n"
        f"  survival rates {[round(r, 2) for r in survival.tolist()]} (pooled: {y.mean():.2f}).\n"
        f"FALD: comm_prob = {COMM_PROB}, batch_size = {BATCH_SIZE}, noise_corr = 1, step size and "
        "preconditioner automatic.\n"
        f"Chains: {NUM_CHAINS} per sampler, {args.warmup} warm-up iterations each, then "
        f"{args.num_samples} FALD / {args.nuts_samples} NUTS draws each."
    )


def run_demo(args) -> dict:
    pyro.set_rng_seed(0)
    x, y = pyro_fed.datasets.titanic()  # x: [2201, 4], first column the intercept; y: survived (0/1)
    clients = pyro_fed.partition.dirichlet(y, num_clients=NUM_CLIENTS, alpha=DIRICHLET_ALPHA, seed=0)
    setup = describe_setup(x, y, clients, args)
    print(setup, flush=True)

    print("\nRunning FALD (federated, 10 clients) ...", flush=True)
    kernel = fald_kernel(clients)
    fald_mcmc, fald_time = run(kernel, x, y, args.num_samples, args)
    setup += f"\nFALD's automatic step size: {kernel.current_step_size:.3g}."
    print(f"FALD's automatic step size: {kernel.current_step_size:.3g}", flush=True)
    start = time.perf_counter()
    fald = pyro_fed.to_inference_data(
        fald_mcmc, log_likelihood=True, posterior_predictive=True, coords=COORDS, dims=DIMS
    )
    fald_arviz_time = time.perf_counter() - start

    print("Running NUTS (pooled data) ...", flush=True)
    # NUTS(model, jit_compile=True) would run about 1.7 times faster here, but Pyro's JIT relies on
    # torch.jit.trace, which recent PyTorch deprecates; the plain kernel is fast enough.
    nuts_mcmc, nuts_time = run(NUTS(model), x, y, args.nuts_samples, args)
    # ArviZ cannot vectorise this model's log-likelihood over draws (x @ w needs w of shape [4]); we do
    # not need it for NUTS here, so skip it rather than get a warning.
    nuts = az.from_pyro(nuts_mcmc, log_likelihood=False, coords=COORDS, dims=DIMS)

    distance = mean_distance(fald, nuts)
    rounds, bits = communication(fald_mcmc)
    times = {"fald": fald_time, "fald_arviz": fald_arviz_time, "nuts": nuts_time}
    data_bits = 32 * y.numel() * x.shape[1]  # per person 3 features + survival, as 32-bit floats
    results = report(
        az.summary(fald, var_names=["w"]),
        az.summary(nuts, var_names=["w"]),
        distance,
        rounds,
        bits,
        data_bits,
        times,
    )
    print("\n" + results)

    args.out.mkdir(parents=True, exist_ok=True)
    title = "# Titanic logistic regression: FALD vs NUTS"
    (args.out / "summary.md").write_text(f"{title}\n\n{setup}\n\n{results}")
    plot_densities(fald, nuts, args.out / "posterior.png")
    print(f"Wrote {args.out / 'summary.md'} and {args.out / 'posterior.png'}")
    return {"distance": distance, "rounds": rounds, "uploaded_bits": bits, "times": times}


def main(argv=None) -> dict:
    """Run the demo; ``argv`` as on the command line (``None``: ``sys.argv``). Returns the key numbers."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        # With 2 chains on a machine with few cores Pyro runs them one after the other, and says so.
        warnings.filterwarnings("ignore", message="num_chains=.*Chains will be drawn sequentially")
        # The tensors are tiny (2201 x 4): extra threads only add synchronisation, which made both
        # samplers 5-10 times slower on a busy 2-core machine. One thread, restored afterwards.
        torch.set_num_threads(1)
        try:
            return run_demo(args)
        finally:
            torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
