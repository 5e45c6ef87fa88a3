r"""The QLSD paper's Gaussian experiment: accuracy against uploaded bits for QLSD#, QLSD⋆ and LSD⋆.

What is measured
----------------
``b = 20`` clients, ``d = 50``; client ``i`` holds :math:`N_i` points (the paper's list, :math:`\sum_i N_i =
2042`) :math:`y_{ij} \sim N(\mu_i, I)` with :math:`\mu_i \sim N(0, 25 I)` (fixed seed), and
:math:`U_i(\theta) = \sum_j \|\theta - y_{ij}\|^2 / 2`. The Pyro model is ``theta ~ N(0, 1000^2 I)`` (a prior
of precision 1e-6 against the data's 2042, so the posterior is the paper's up to 5e-10 relative) and
``y ~ N(theta, I)`` over a data plate. Every kernel uses the paper's step :math:`\gamma = 1/2042` (no
preconditioner) and minibatches of :math:`n_i = \lfloor N_i / 10 \rfloor` (``batch_size=0.1``):

- QLSD# (``QlsdKernel(..., quantization_levels=s)``) and QLSD⋆ (``control_variate="fixed_point"``, the
  fixed point found by L-BFGS) with :math:`s = 2^4, 2^8, 2^{16}`;
- LSD⋆ (QLSD⋆ without compression).

For each, ``--chains`` independent chains (one batched run) of ``--warmup`` + ``--samples`` iterations; the
statistic of a chain is :math:`\hat\sigma^2 = \frac1K \sum_k \|\theta_k - \bar\theta\|^2` over the draws
after warm-up, :math:`\bar\theta` the exact posterior mean, and its MSE against the exact
:math:`\sigma_\star^2 = d / (N + 10^{-6})` is averaged over the chains (standard error printed). The uploaded
bits are the kernel's own count (``mcmc.diagnostics()["uploaded bits"]``: every client uploads one
quantised message of :math:`d` numbers per iteration, warm-up included), per chain.

Claims of the paper checked: QLSD⋆ beats QLSD# at every ``s``; QLSD⋆ at :math:`s = 2^{16}` reaches LSD⋆'s
MSE with about 2.6x fewer bits. At this step (:math:`\gamma \lambda = 1`) the discretisation bias alone
doubles :math:`\sigma^2` (Langevin's stationary variance is :math:`1/(\lambda(1 - \gamma\lambda/2))`), so
every sampler's MSE has a floor of :math:`\sigma_\star^4`; what separates them is the gradient noise.

Run::

    python benchmarks/qlsd_gaussian.py            # 10 chains x (500 + 5000) iterations (about 3 minutes)
    python benchmarks/qlsd_gaussian.py --quick    # 4 chains x (100 + 500), a smoke run

Results: ``benchmarks/results/qlsd_gaussian{,_quick}.{md,json,png}`` (``--out`` changes the folder).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from common import save_log_log_figure
from pyro.infer import MCMC

from pyro_fed import QlsdKernel

CLIENT_SIZES = [192, 109, 44, 90, 86, 40, 162, 14, 94, 15, 49, 166, 190, 141, 156, 47, 116, 77, 135, 119]
DIM = 50
PRIOR_SD = 1000.0


def model(y):
    theta = pyro.sample("theta", dist.Normal(0.0, PRIOR_SD).expand([DIM]).to_event(1))
    with pyro.plate("data", y.shape[0]) as idx:
        pyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y[idx])


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    means = 5.0 * torch.randn(len(CLIENT_SIZES), DIM, generator=g, dtype=torch.float64)
    clients = torch.repeat_interleave(torch.arange(len(CLIENT_SIZES)), torch.tensor(CLIENT_SIZES))
    y = means[clients] + torch.randn(len(clients), DIM, generator=g, dtype=torch.float64)
    return y, clients


def settings() -> list[tuple[str, dict]]:
    out = []
    for levels in (2**4, 2**8, 2**16):
        out.append((f"QLSD# s=2^{int(np.log2(levels))}", {"quantization_levels": levels}))
        out.append(
            (
                f"QLSD⋆ s=2^{int(np.log2(levels))}",
                {"quantization_levels": levels, "control_variate": "fixed_point"},
            )
        )
    out.append(("LSD⋆", {"control_variate": "fixed_point"}))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chains", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    chains, warmup, samples = (4, 100, 500) if args.quick else (10, 500, 5000)
    chains = args.chains or chains
    torch.set_default_dtype(torch.float64)
    y, clients = make_data()
    num_data = len(y)
    precision = num_data + PRIOR_SD**-2
    exact_mean = y.sum(0) / precision
    sigma2 = DIM / precision
    rows = []
    for name, options in settings():
        pyro.set_rng_seed(1)
        kernel = QlsdKernel(model, clients, step_size=1.0 / num_data, batch_size=0.1, **options)
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(y)
        seconds = time.perf_counter() - start
        draws = mcmc.get_samples(group_by_chain=True)["theta"]  # [chains, samples, d]
        statistic = (draws - exact_mean).square().sum(-1).mean(-1)  # [chains]
        errors = (statistic - sigma2).square().numpy()
        bits = np.array(list(mcmc.diagnostics()["uploaded bits"].values()), dtype=float)
        row = {
            "sampler": name,
            "mse": float(errors.mean()),
            "mse_se": float(errors.std(ddof=1) / np.sqrt(len(errors))),
            "sigma2_ratio": float(statistic.mean() / sigma2),
            "bits_per_chain": float(bits.mean()),
            "bits_per_iteration": float(bits.mean() / (warmup + samples)),
            "seconds": seconds,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args, chains, warmup, samples, sigma2)


def write(rows, args, chains, warmup, samples, sigma2) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "qlsd_gaussian_quick" if args.quick else "qlsd_gaussian"
    (args.out / f"{stem}.json").write_text(json.dumps({"rows": rows, "sigma2": sigma2}, indent=2))
    by_name = {r["sampler"]: r for r in rows}
    lines = [
        "# QLSD paper's Gaussian experiment: MSE of the sigma^2 statistic against uploaded bits",
        "",
        f"Written by `benchmarks/qlsd_gaussian.py{' --quick' if args.quick else ''}` (see its docstring): "
        f"b = 20, d = 50, gamma = 1/2042, n_i = floor(N_i / 10); {chains} chains x ({warmup} + {samples}) "
        f"iterations; sigma_star^2 = {sigma2:.5f}.",
        "",
        "| sampler | MSE | ± se | E[sigma^2 stat] / sigma_star^2 | bits / iteration | bits per chain | s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sampler']} | {r['mse']:.3g} | {r['mse_se']:.2g} | {r['sigma2_ratio']:.3f} | "
            f"{r['bits_per_iteration']:.0f} | {r['bits_per_chain']:.3g} | {r['seconds']:.1f} |"
        )
    lines += ["", "## The paper's claims, checked", ""]
    for p in (4, 8, 16):
        sharp, star = by_name[f"QLSD# s=2^{p}"], by_name[f"QLSD⋆ s=2^{p}"]
        verdict = (
            "yes" if star["mse"] + 2 * star["mse_se"] < sharp["mse"] - 2 * sharp["mse_se"] else "not shown"
        )
        lines.append(
            f"- QLSD⋆ beats QLSD# at s = 2^{p}: {verdict} (MSE {star['mse']:.3g} ± {star['mse_se']:.2g} "
            f"vs {sharp['mse']:.3g} ± {sharp['mse_se']:.2g})."
        )
    star16, lsd = by_name["QLSD⋆ s=2^16"], by_name["LSD⋆"]
    ratio = lsd["bits_per_iteration"] / star16["bits_per_iteration"]
    gap = abs(star16["mse"] - lsd["mse"]) / max(np.hypot(star16["mse_se"], lsd["mse_se"]), 1e-300)
    lines.append(
        f"- QLSD⋆ at s = 2^16 pays {ratio:.2f}x fewer bits than LSD⋆ (paper: about 2.6x) for an MSE "
        f"{star16['mse']:.3g} ± {star16['mse_se']:.2g} against {lsd['mse']:.3g} ± {lsd['mse_se']:.2g} "
        f"({gap:.1f} standard errors apart)."
    )
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)

    def draw(axis):
        for family, marker in (("QLSD#", "o"), ("QLSD⋆", "s"), ("LSD⋆", "*")):
            chosen = [r for r in rows if r["sampler"].split(" ")[0] == family]
            axis.errorbar(
                [r["bits_per_chain"] for r in chosen],
                [r["mse"] for r in chosen],
                yerr=[2 * r["mse_se"] for r in chosen],
                marker=marker,
                linestyle="-" if len(chosen) > 1 else "none",
                label=family,
            )

    save_log_log_figure(
        args.out / f"{stem}.png", draw, "uploaded bits per chain", "MSE of the sigma^2 statistic"
    )
    print(text)


if __name__ == "__main__":
    main()
