r"""D-ULA on the Welling–Teh Gaussian mixture: 5 agents on a ring, a complete graph and a path, against
centralized ULA and the exact posterior computed on a grid.

What is measured
----------------
The model of Welling & Teh (2011): :math:`\theta_1 \sim N(0, 10)`, :math:`\theta_2 \sim N(0, 1)`,
:math:`x_j \sim \tfrac12 N(\theta_1, 2) + \tfrac12 N(\theta_1 + \theta_2, 2)`, 100 points drawn from
:math:`\theta = (0, 1)` with a fixed seed, 20 per agent. Its posterior has two modes. The exact posterior is
computed on a 400 × 400 grid over :math:`[-3, 4] \times [-4, 4]`.

Samplers, with the paper's step sizes (given, no adaptation): :math:`\alpha_k = 0.2 / (230 + k)^{0.55}`
(``step_size=0.2, schedule="decaying", step_offset=229, step_decay=0.55``),
:math:`\beta_k = 1.01 / \lambda_{\max}(L) / (k + 1)^{0.04}` (``consensus_size=1.01 / lambda_max``), full local
batches:

- :class:`~pyro_fed.DulaKernel` with ``graph="ring"``, ``"complete"`` and ``"path"``;
- centralized ULA, :class:`~pyro_fed.SgldKernel` with the same :math:`\alpha_k` (C-ULA in the paper).

Each runs ``--chains`` chains (one batch) of ``--iterations`` iterations from the prior median. At
iterations :math:`K` of a geometric grid, the draws from :math:`K/10` to :math:`K` (all chains pooled) are
binned on a 40 × 40 grid over the same box and compared with the exact posterior's bin masses by the
Kullback–Leibler divergence :math:`\sum_{bins} \hat p \log(\hat p / p)` and the total variation distance
:math:`\tfrac12 \sum_{bins} |\hat p - p|` (a finite sample has a floor of its own: for independent draws
a TV of at most about :math:`\sqrt{\text{bins} / (2\pi\, \text{draws})}`), and by the error of the
posterior mean in posterior sds. Bits: each agent sends 2 floats to each neighbour per iteration.

Run::

    python benchmarks/dula_gmm.py            # 4 chains x 20000 iterations (about 4 minutes)
    python benchmarks/dula_gmm.py --quick    # a smoke run

Results: ``benchmarks/results/dula_gmm{,_quick}.{md,json,png}`` (``--out`` changes the folder).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from common import save_log_log_figure
from pyro.infer import MCMC

from pyro_fed import DulaKernel, SgldKernel
from pyro_fed.network.graphs import make_graph

BOX = ((-3.0, 4.0), (-4.0, 4.0))
NUM_AGENTS = 5


def model(x):
    theta1 = pyro.sample("theta1", dist.Normal(0.0, math.sqrt(10.0)))
    theta2 = pyro.sample("theta2", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]) as idx:
        locs = torch.stack([theta1, theta1 + theta2], -1).expand(idx.shape[0], 2)
        components = dist.Normal(locs, math.sqrt(2.0))
        mixture = dist.MixtureSameFamily(dist.Categorical(probs=torch.full((2,), 0.5)), components)
        pyro.sample("x", mixture, obs=x[idx])


def make_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    which = torch.rand(100, generator=g) < 0.5
    return torch.where(which, 0.0, 1.0) + math.sqrt(2.0) * torch.randn(100, generator=g)


def grid_posterior(x: torch.Tensor, size: int = 400):
    t1 = torch.linspace(*BOX[0], size)
    t2 = torch.linspace(*BOX[1], size)
    a, b = torch.meshgrid(t1, t2, indexing="ij")
    log_p = dist.Normal(0.0, math.sqrt(10.0)).log_prob(a) + dist.Normal(0.0, 1.0).log_prob(b)
    comp1 = dist.Normal(a[..., None], math.sqrt(2.0)).log_prob(x)
    comp2 = dist.Normal((a + b)[..., None], math.sqrt(2.0)).log_prob(x)
    log_p = log_p + (torch.logaddexp(comp1, comp2) - math.log(2.0)).sum(-1)
    p = (log_p - log_p.max()).exp()
    return a, b, p / p.sum()


def bin_masses(points: np.ndarray, bins: int = 40) -> np.ndarray:
    hist, _, _ = np.histogram2d(points[:, 0], points[:, 1], bins=bins, range=BOX)
    return hist / max(len(points), 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    chains, iterations = (2, 2000) if args.quick else (4, 20000)
    torch.set_default_dtype(torch.float64)
    x = make_data()
    a, b, p = grid_posterior(x)
    # the exact bin masses: the grid's probability summed per bin
    grid = (a.flatten().numpy(), b.flatten().numpy())
    exact_bins, _, _ = np.histogram2d(*grid, bins=40, range=BOX, weights=p.flatten().numpy())
    mean = np.array([float((a * p).sum()), float((b * p).sum())])
    sd = np.sqrt(np.array([float(((a - mean[0]) ** 2 * p).sum()), float(((b - mean[1]) ** 2 * p).sum())]))
    clients = torch.arange(100) // 20
    checkpoints = sorted({int(k) for k in np.geomspace(200, iterations, 8)})
    rows, curves = [], {}
    samplers = [(f"D-ULA {g}", g) for g in ("ring", "complete", "path")] + [("C-ULA", None)]
    for name, graph in samplers:
        pyro.set_rng_seed(1)
        options = {
            "step_size": 0.2,
            "schedule": "decaying",
            "step_offset": 229,
            "step_decay": 0.55,
            "gradient_mode": "traced",
        }
        if graph is None:
            kernel = SgldKernel(model, **options)
        else:
            consensus = 1.01 / make_graph(graph, NUM_AGENTS).lambda_max
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the paper's delta_1 = 0.04 with delta_2 = 0.55 satisfies it
                kernel = DulaKernel(model, clients, graph=graph, consensus_size=consensus, **options)
        mcmc = MCMC(kernel, num_samples=iterations, warmup_steps=0, num_chains=chains, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(x)
        seconds = time.perf_counter() - start
        samples = mcmc.get_samples(group_by_chain=True)
        draws = torch.stack([samples["theta1"], samples["theta2"]], -1).numpy()  # [chains, K, 2]
        curve = []
        for k in checkpoints:
            window = draws[:, k // 10 : k].reshape(-1, 2)
            masses = bin_masses(window)
            tv = 0.5 * np.abs(masses - exact_bins).sum()
            seen = masses > 0
            kl = float((masses[seen] * np.log(masses[seen] / exact_bins[seen])).sum())
            mean_err = float(np.max(np.abs(window.mean(0) - mean) / sd))
            curve.append({"iteration": k, "tv": float(tv), "kl": kl, "mean_err": mean_err})
        curves[name] = curve
        bits = np.mean(list(mcmc.diagnostics()["uploaded bits"].values()))
        row = {
            "sampler": name,
            **curve[-1],
            "bits_per_iteration": float(bits / iterations),
            "seconds": seconds,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, curves, args, chains, iterations)


def write(rows, curves, args, chains, iterations) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "dula_gmm_quick" if args.quick else "dula_gmm"
    (args.out / f"{stem}.json").write_text(json.dumps({"rows": rows, "curves": curves}, indent=2))
    floor = math.sqrt(1600 / (2 * math.pi * chains * iterations * 0.9))
    lines = [
        "# D-ULA on the Welling–Teh Gaussian mixture (5 agents) vs centralized ULA and the exact posterior",
        "",
        f"Written by `benchmarks/dula_gmm.py{' --quick' if args.quick else ''}` (see its docstring): "
        f"{chains} chains x {iterations} iterations; TV over 40 x 40 bins of the draws from K/10 to K (that "
        f"many independent exact draws would give a TV of at most about {floor:.3f}; correlated draws give "
        "more).",
        "",
        "| sampler | TV at the end | KL at the end | max mean error (sds) | bits / iteration | s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sampler']} | {r['tv']:.3f} | {r['kl']:.3f} | {r['mean_err']:.3f} | "
            f"{r['bits_per_iteration']:.0f} | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        "TV against iterations:",
        "",
        "| K | " + " | ".join(curves) + " |",
        "|---:" * (len(curves) + 1) + "|",
    ]
    for i, point in enumerate(next(iter(curves.values()))):
        lines.append(
            f"| {point['iteration']} | " + " | ".join(f"{c[i]['tv']:.3f}" for c in curves.values()) + " |"
        )
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)

    def draw(axis):
        for name, curve in curves.items():
            axis.plot([c["iteration"] for c in curve], [c["tv"] for c in curve], marker="o", label=name)

    save_log_log_figure(
        args.out / f"{stem}.png", draw, "iterations", "TV to the exact posterior (40 x 40 bins)"
    )
    print(text)


if __name__ == "__main__":
    main()
