r"""Relative HPD error of QLSD++ against LSD++, and what it saves in bits: Titanic logistic regression.

What is measured
----------------
The README's logistic regression (``d = 4``: intercept, class, sex, age; prior :math:`N(0, I)`) on the
Titanic table, split into ``b = 10`` clients by a Dirichlet(0.5) label skew. Reference: Pyro's NUTS on the
pooled data (``--ref-samples`` draws after 500 warm-up). Then :class:`~pyro_fed.QlsdKernel` with
``control_variate="svrg"`` (snapshots every 20 iterations), minibatches of a tenth of each client's data,
the automatic step size and preconditioner, and its default memory rate :math:`1/(\omega+1)`:

- QLSD++ with :math:`s = 2^4, 2^8, 2^{16}` quantisation levels, and LSD++ (no compression);
- each as ``--chains`` chains of 500 warm-up + ``--samples`` draws, with full participation and with each
  client present with probability 0.5.

For every run: :math:`\eta_\alpha` (``alpha = 0.05``), the empirical 95% quantile of the full-data potential
:math:`U(\theta_k)` over the draws (:func:`pyro_fed.metrics.hpd_level`), its relative error against the
reference's (:func:`pyro_fed.metrics.relative_hpd_error`), and the bits uploaded per iteration (the kernel's
own count); the *relative bit efficiency* is LSD++'s bits per iteration over the run's. The paper's claim
(on larger models): QLSD++ matches LSD++'s HPD error while 3–7x cheaper in bits. With ``d = 4`` the 32 bits
of each message's norm weigh more than at the paper's ``d = 784``, so the saving here is smaller.

Run::

    python benchmarks/qlsd_hpd.py            # about 5 minutes on 2 CPU cores
    python benchmarks/qlsd_hpd.py --quick    # a smoke run

Results: ``benchmarks/results/qlsd_hpd{,_quick}.{md,json}`` (``--out`` changes the folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS

import pyro_fed
from pyro_fed import QlsdKernel
from pyro_fed.metrics import draw_potentials, hpd_level, relative_hpd_error

ALPHA = 0.05


def model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    chains, samples, ref_samples = (2, 500, 500) if args.quick else (4, 5000, 5000)
    torch.set_default_dtype(torch.float64)
    x, y = pyro_fed.datasets.titanic()
    clients = pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5, seed=0)

    pyro.set_rng_seed(0)
    reference = MCMC(NUTS(model), num_samples=ref_samples, warmup_steps=500, disable_progbar=True)
    reference.run(x, y)
    rows = []
    potential = None
    for participation in (1.0, 0.5):
        for levels in (2**4, 2**8, 2**16, None):
            pyro.set_rng_seed(1)
            kernel = QlsdKernel(
                model,
                clients,
                quantization_levels=levels,
                control_variate="svrg",
                snapshot_every=20,
                participation=participation,
                batch_size=0.1,
            )
            mcmc = MCMC(
                kernel, num_samples=samples, warmup_steps=500, num_chains=chains, disable_progbar=True
            )
            mcmc.run(x, y)
            potential = kernel.potential
            level = hpd_level(draw_potentials(potential, mcmc.get_samples()), ALPHA)
            bits = np.mean(list(mcmc.diagnostics()["uploaded bits"].values())) / (500 + samples)
            rows.append(
                {
                    "sampler": "LSD++" if levels is None else f"QLSD++ s=2^{int(np.log2(levels))}",
                    "participation": participation,
                    "eta": level,
                    "step_size": kernel.current_step_size,
                    "bits_per_iteration": float(bits),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    reference_level = hpd_level(draw_potentials(potential, reference.get_samples()), ALPHA)
    for row in rows:
        row["relative_hpd_error"] = relative_hpd_error(row["eta"], reference_level)
        lsd = next(r for r in rows if r["sampler"] == "LSD++" and r["participation"] == row["participation"])
        row["bit_efficiency"] = lsd["bits_per_iteration"] / row["bits_per_iteration"]
    write(rows, reference_level, args, chains, samples, ref_samples)


def write(rows, reference_level, args, chains, samples, ref_samples) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "qlsd_hpd_quick" if args.quick else "qlsd_hpd"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"rows": rows, "reference_eta": reference_level}, indent=2)
    )
    lines = [
        "# Relative HPD error of QLSD++ against LSD++ (Titanic, 10 Dirichlet clients)",
        "",
        f"Written by `benchmarks/qlsd_hpd.py{' --quick' if args.quick else ''}` (see its docstring): "
        f"{chains} chains x (500 + {samples}) iterations per run; reference eta_0.05 = {reference_level:.3f} "
        f"from NUTS ({ref_samples} draws).",
        "",
        "| sampler | participation | eta_0.05 | relative HPD error | bits / iteration "
        "| relative bit efficiency | step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sampler']} | {r['participation']} | {r['eta']:.3f} | {r['relative_hpd_error']:.2e} | "
            f"{r['bits_per_iteration']:.0f} | {r['bit_efficiency']:.2f} | {r['step_size']:.3g} |"
        )
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
