r"""Relative HPD error of QLSD++ against LSD++ and the baselines, and their bits: logistic regressions.

What is measured
----------------
A Bayesian logistic regression (prior :math:`N(0, I)`) split into ``b = 10`` clients by a Dirichlet(0.5)
label skew (:func:`pyro_fed.partition.dirichlet`, seed 0), on one of two data sets (``--dataset``):

- ``titanic`` (default): the README's model, ``d = 4`` (intercept, class, sex, age), 2201 people.
  Reference: Pyro's NUTS on the pooled data (5000 draws after 500 warm-up).
- ``digits``: scikit-learn's bundled 8x8 digits (1797 images, no download), pixels / 16 plus an intercept
  (65 features), multinomial logistic regression with 10 classes, weights ``[65, 10]``: ``d = 650``.
  Reference: NUTS on the pooled data (2000 draws after 500 warm-up), run in whitened coordinates
  :math:`w = w_\star + A z` (:math:`w_\star` the mode, :math:`AA^\top` the inverse Hessian there): a linear
  change of variables, so the same posterior, on which NUTS (no mass matrix adaptation: ``z`` is nearly
  isotropic) takes trees of ~16 steps of size ~0.3 (about 3 minutes). Plain NUTS on ``w`` ran at about 1 s
  per iteration (step 0.05, trees of ~2^10 steps: the posterior's scales span pixels that are always 0 to
  well-determined weights), too slow for this budget.

Then :class:`~pyro_fed.QlsdKernel` with ``control_variate="svrg"`` (snapshots every 20 iterations),
minibatches of a tenth of each client's data, the automatic step size and preconditioner, and its default
memory rate :math:`1/(\omega+1)`:

- QLSD++ with :math:`s = 2^4, 2^8, 2^{16}` quantisation levels, and LSD++ (no compression);
- each with full participation and with each client present with probability 0.5;
- Titanic: 4 chains x (500 warm-up + 5000 draws) kept every 2nd iteration (11000 iterations per chain),
  from the kernel's default start. The warm-up would choose the thinning itself (12 for QLSD++, 100 for
  pSGLD, FSGLD and DG-LMC, whose automatic steps are small): 12 to 100 times this budget on the 2 busy
  cores, so every run is given ``thinning=2`` and the same iterations; the draws are then autocorrelated,
  which the quantile mcse accounts for;
- digits: 8 chains x (500 warm-up + 4000 iterations, kept every 4th: 1000 draws), traced (not compiled:
  TorchInductor's compilation cost minutes on the busy 2-core machine), each chain *started at a reference
  draw* (8 evenly spaced ones). From the kernel's default start (a draw of the diagonal Laplace
  approximation) the potential first drops then climbs back over ~1/(2 h lambda_min) ~ 6000 iterations at
  the automatic step h ~ 0.003 (lambda_min ~ 0.03 for the preconditioned Hessian; the recorded run chose
  the same step for every sampler and participation: the stiffness at typical points binds, not the
  gradient noise): an earlier smoke run of 700 iterations gave eta 55-125 below the reference, ordered by
  step size, i.e. it measured the transient. Started at posterior draws, the runs measure how far each sampler
  drifts from the posterior where it can move within 4500 iterations (the stiff directions, where the
  step's and the gradient noise's biases act); the slowest directions barely leave the posterior draw,
  so a bias there would be missed (that would need ~10^5 iterations per run).

Then the **baselines** that count their bits, each at its defaults but the minibatch (a tenth of each
client's data, as QLSD's) and the thinning (as above), every client present, the same chains, seed and
iterations (``--no-baselines`` skips them):

- pSGLD (:class:`~pyro_fed.PsgldKernel`, Li et al. 2016; decay 0.99, damping 1e-5): every client uploads its
  minibatch gradient every iteration (``32 d`` bits), the server preconditions by their running second
  moment;
- FSGLD (:class:`~pyro_fed.FsgldKernel`, El Mekkaoui et al. 2021) with ``K = 1`` and ``K = 10`` local steps:
  one client a round (drawn with :math:`p_i = N_i / N`) takes the steps with the conducive gradient of the
  Laplace surrogates fitted at the mode (set-up: :math:`d^2 + d` floats a client); a round uploads ``32 d``
  bits, so per iteration FSGLD uploads :math:`1/(bK)` of LSD++'s;
- DG-LMC (:class:`~pyro_fed.DglmcKernel`, Plassier et al. 2021; automatic tolerance and step, one local
  step): every client uploads its :math:`z_i` every iteration, as LSD++'s gradients; the QLSD paper's
  "DG-SGLD" is this sampler with minibatch gradients;
- SVRG-LD on the pooled data (:class:`~pyro_fed.SvrgLdKernel`, Dubey et al. 2016): the centralised
  reference; its bits are what the one holder of the data would send a server (``32 d`` an iteration).

The QLSD paper's own numbers for DG-SGLD and FSGLD (its Table 3, FEMNIST) are not in the extracted text
this project has; its text says that QLSD++ "provides similar performances as DG-SGLD and FSGLD" in relative
HPD error while "3 to 7 times more efficient" in bits than LSD++ (at :math:`\alpha = 0.01` there; 0.05
here). The results' table has no paper column for that reason.

For every run: :math:`\eta_\alpha` (``alpha = 0.05``), the empirical 95% quantile of the full-data potential
:math:`U(\theta_k)` over the draws (:func:`pyro_fed.metrics.hpd_level`), its Monte Carlo standard error
(ArviZ's ``mcse(method="quantile", prob=0.95)`` over the chains, which accounts for autocorrelation; the
per-chain :math:`\eta` are in the JSON as a cross-check), its relative error against the reference's
(:func:`pyro_fed.metrics.relative_hpd_error`) and the distance of :math:`\eta` to LSD++'s in combined
standard errors; and the bits uploaded per iteration from the kernel's own count, twice: over the whole run
(the ``uploaded bits`` diagnostic, which includes the set-up's mode search and curvatures, over warm-up +
draws) and over the sampling iterations only (from the cumulative ``uploaded_bits`` sample statistic). The
*relative bit efficiency* is LSD++'s bits per iteration over the run's. The paper's claim (on ``d = 784``
models): QLSD++ matches LSD++'s HPD error while 3–7x cheaper in bits. With ``d = 4`` the 32 bits of each
message's norm weigh more, so Titanic's saving is smaller; digits (``d = 650``) is near the paper's size.

Digits' time: about 3 minutes of NUTS and about 70 s per QLSD or baseline run (of which ~10-20 s set-up:
mode search, curvatures, noise measurement); the recorded run, with the baselines, took 16 minutes on one
thread, NUTS's reference 91 s of it. Reading its baseline rows: SVRG-LD (the pooled data, one
"client") and FSGLD with one local step match LSD++'s HPD error at a tenth of its bits (FSGLD uploads one
client's message per iteration); FSGLD with 10 local steps sits 2 standard errors below LSD++ (as on Titanic:
its stationary bias, see :mod:`pyro_fed.algorithms.fsgld`); DG-LMC's tiny automatic step leaves its eta's
standard error 5 times QLSD++'s; pSGLD is wrong by 6% (eta 15 standard errors above LSD++'s: its draws too
wide at ``d = 650``), the bias its kernel warns of before the run: its slowest direction relaxes over about
2,400 iterations while :math:`V` averages the squared gradients over 100, so :math:`G` follows the chain
there and the dropped :math:`\Gamma` term of its update widens it (see :mod:`pyro_fed.algorithms.psgld`); the
warning names ``decay=0.99996`` as the remedy, which this run, at pSGLD's defaults, does not take.

Titanic's recorded run (with the baselines): 16.5 minutes, one thread, on 2 CPU cores shared with other jobs.
Reading its baseline rows: pSGLD's, FSGLD's and DG-LMC's automatic steps are small (their warm-up would thin
by 100), so at the same 11000 iterations their chains mix less and their eta's standard errors are 3 to 8
times QLSD++'s; FSGLD with 10 local steps takes a step 10 times smaller again (it pays for the round's
persistent client error), and its eta falls below LSD++'s by several standard errors: too concentrated
draws, from its stationary bias (10 steps of one client are not 10 steps of their average, see
:mod:`pyro_fed.algorithms.fsgld`) or from a start not yet relaxed at that step; this run does not tell
which.

Run::

    python benchmarks/qlsd_hpd.py                      # Titanic, about 17 minutes on 2 busy CPU cores
    python benchmarks/qlsd_hpd.py --dataset digits     # digits, about 16 minutes on one idle CPU core
    python benchmarks/qlsd_hpd.py [--dataset digits] --quick    # smoke runs (a few minutes each)

Results: ``benchmarks/results/qlsd_hpd{,_quick}.{md,json}`` (Titanic) and
``qlsd_hpd_digits{,_quick}.{md,json}`` (digits); ``--out`` changes the folder.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from common import logistic_regression
from pyro import poutine
from pyro.infer import MCMC, NUTS
from pyro.infer.mcmc.util import initialize_model

import pyro_fed
from pyro_fed import QlsdKernel
from pyro_fed.output.metrics import draw_potentials, hpd_level, relative_hpd_error

ALPHA = 0.05
WARMUP = 500
#: the baselines with bit accounting: (row name, kernel maker)
BASELINES = (
    ("pSGLD", lambda model, clients, kw: pyro_fed.PsgldKernel(model, clients, **kw)),
    ("FSGLD K=1", lambda model, clients, kw: pyro_fed.FsgldKernel(model, clients, **kw)),
    ("FSGLD K=10", lambda model, clients, kw: pyro_fed.FsgldKernel(model, clients, local_steps=10, **kw)),
    ("DG-LMC", lambda model, clients, kw: pyro_fed.DglmcKernel(model, clients, **kw)),
    ("SVRG-LD (pooled)", lambda model, clients, kw: pyro_fed.SvrgLdKernel(model, **kw)),
)


def digits_model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1], 10]).to_event(2))
    with pyro.plate("data", x.shape[0]):
        logits = pyro.subsample(x, event_dim=1) @ w
        pyro.sample("y", dist.Categorical(logits=logits), obs=pyro.subsample(y, event_dim=0))


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = torch.as_tensor(data.data, dtype=torch.get_default_dtype()) / 16
    return torch.cat([torch.ones(len(pixels), 1), pixels], 1), torch.as_tensor(data.target)


# per data set: title, data, model, whitened reference, chains started at reference draws, kernel options,
# and the full and quick sizes (chains, draws per run, reference draws)
DATASETS = {
    "titanic": ("Titanic, d = 4", pyro_fed.datasets.titanic, logistic_regression, False, False,
                dict(thinning=2), (4, 5000, 5000), (2, 500, 500)),
    "digits": ("digits, d = 650", digits, digits_model, True, True, dict(thinning=4, gradient_mode="traced"),
               (8, 1000, 2000), (2, 100, 300)),
}  # fmt: skip


def nuts_reference(model, x, y, samples, whiten):
    """NUTS on the pooled data: draws ``{"w": [K, ...]}``; ``whiten``: in the coordinates ``z`` of
    ``w = mode + A z``, with ``A A^T`` the inverse Hessian of the potential at the mode."""
    if not whiten:
        mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=WARMUP, disable_progbar=True)
        mcmc.run(x, y)
        return mcmc.get_samples()
    _, potential_fn, _, _ = initialize_model(model, model_args=(x, y))
    shape = poutine.trace(model).get_trace(x, y).nodes["w"]["value"].shape

    def potential(flat):
        return potential_fn({"w": flat.reshape(shape)})

    flat = torch.zeros(shape.numel(), requires_grad=True)
    lbfgs = torch.optim.LBFGS([flat], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        value = potential(flat)
        value.backward()
        return value

    lbfgs.step(closure)
    mode = flat.detach()
    a = torch.linalg.cholesky(torch.linalg.inv(torch.autograd.functional.hessian(potential, mode)))
    # z is near-isotropic: a mass matrix adapted over the warm-up's short windows only made deeper trees
    kernel = NUTS(potential_fn=lambda params: potential(mode + a @ params["z"]), adapt_mass_matrix=False)
    mcmc = MCMC(kernel, samples, WARMUP, initial_params={"z": torch.zeros_like(mode)}, disable_progbar=True)
    mcmc.run()
    return {"w": (mode + mcmc.get_samples()["z"] @ a.T).reshape(-1, *shape)}


def hpd(potential, samples, chains):
    """eta, its Monte Carlo standard error and the per-chain etas of draws ``{site: [chains * K, ...]}``."""
    potentials = draw_potentials(potential, samples).reshape(chains, -1)
    return {
        "eta": hpd_level(potentials.flatten(), ALPHA),
        "eta_mcse": float(az.mcse(potentials.numpy(), method="quantile", prob=1 - ALPHA)),
        "eta_per_chain": [hpd_level(p, ALPHA) for p in potentials],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="titanic")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-baselines", action="store_true", help="QLSD++ and LSD++ only")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    title, data, model, whiten, start_at_reference, options, full, quick = DATASETS[args.dataset]
    chains, samples, ref_samples = quick if args.quick else full
    thinning = options.get("thinning", 1)
    torch.set_default_dtype(torch.float64)
    x, y = data()
    clients = pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5, seed=0)
    start = time.perf_counter()

    pyro.set_rng_seed(0)
    reference = nuts_reference(model, x, y, ref_samples, whiten)
    ref_seconds = time.perf_counter() - start
    initial = None
    if start_at_reference:  # evenly spaced reference draws
        initial = {k: v[torch.linspace(0, ref_samples - 1, chains).long()] for k, v in reference.items()}
    rows = []
    potential = None

    def run(sampler, participation, kernel, run_start):
        nonlocal potential
        mcmc = MCMC(
            kernel,
            num_samples=samples,
            warmup_steps=WARMUP // thinning,
            num_chains=chains,
            initial_params=initial,
            disable_progbar=True,
        )
        mcmc.run(x, y)
        potential = kernel.potential
        diagnostics = mcmc.diagnostics()
        every = kernel.current_thinning  # the given thinning: warm-up and draws are `every` iterations each
        iterations = (WARMUP // thinning + samples) * every
        bits = np.mean(list(diagnostics["uploaded bits"].values())) / iterations
        # the sample statistic is cumulative: its growth over the draws
        stats = [kernel.sample_stats(chain) for chain in range(mcmc.num_chains)]
        sampling = np.mean([s["uploaded_bits"][-1] - s["uploaded_bits"][0] for s in stats])
        rows.append(
            {
                "sampler": sampler,
                "participation": participation,
                **hpd(potential, mcmc.get_samples(), chains),
                "step_size": kernel.current_step_size,
                "thinning": every,
                "iterations_per_chain": iterations,
                "bits_per_iteration": float(bits),
                "sampling_bits_per_iteration": float(sampling / ((samples - 1) * every)),
                "seconds": time.perf_counter() - run_start,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    for participation in (1.0, 0.5):
        for levels in (2**4, 2**8, 2**16, None):
            pyro.set_rng_seed(1)
            run_start = time.perf_counter()
            kernel = QlsdKernel(
                model,
                clients,
                quantization_levels=levels,
                control_variate="svrg",
                snapshot_every=20,
                participation=participation,
                batch_size=0.1,
                **options,
            )
            name = "LSD++" if levels is None else f"QLSD++ s=2^{int(np.log2(levels))}"
            run(name, participation, kernel, run_start)
    if not args.no_baselines:
        # the baselines at their defaults but the minibatch (a tenth of each client's data, as QLSD's) and
        # the thinning (the QLSD runs': the same iterations); every client present
        common = {**options, "batch_size": 0.1}
        for name, make in BASELINES:
            pyro.set_rng_seed(1)
            run_start = time.perf_counter()
            run(name, 1.0, make(model, clients, common), run_start)
    ref = {**hpd(potential, reference, 1), "seconds": ref_seconds}
    for row in rows:
        row["relative_hpd_error"] = relative_hpd_error(row["eta"], ref["eta"])
        row["relative_hpd_error_se"] = float(np.hypot(row["eta_mcse"], ref["eta_mcse"]) / abs(ref["eta"]))
        lsd = next(r for r in rows if r["sampler"] == "LSD++" and r["participation"] == row["participation"])
        row["eta_minus_lsd_in_se"] = (row["eta"] - lsd["eta"]) / np.hypot(row["eta_mcse"], lsd["eta_mcse"])
        for kind in ("", "sampling_"):
            row[f"{kind}bit_efficiency"] = lsd[f"{kind}bits_per_iteration"] / row[f"{kind}bits_per_iteration"]
    ref_text = f"NUTS on the pooled data{', whitened' if whiten else ''} ({ref_samples} draws)"
    runs = f"{chains} chains x ({WARMUP} + {samples * thinning}) iterations" + (
        f", every {thinning}th kept" if thinning > 1 else ""
    )
    if start_at_reference:
        runs += ", started at reference draws"
    if not args.no_baselines:
        runs += " (the baselines too, every client present)"
    write(rows, ref, ref_text, time.perf_counter() - start, args, title, runs)


def write(rows, ref, ref_text, seconds, args, title, runs) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = "" if args.dataset == "titanic" else f"_{args.dataset}"
    stem = f"qlsd_hpd{dataset}{'_quick' if args.quick else ''}"
    results = {
        "rows": rows,
        "reference_eta": ref["eta"],
        "reference": {**ref, "what": ref_text},
        "seconds": seconds,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    options = (f" --dataset {args.dataset}" if dataset else "") + (" --quick" if args.quick else "")
    lines = [
        f"# Relative HPD error of QLSD++ against LSD++, and the baselines ({title}, 10 Dirichlet clients)",
        "",
        f"Written by `benchmarks/qlsd_hpd.py{options}` (see its docstring) in {seconds / 60:.1f} min: "
        f"{runs} per run; reference eta_0.05 = {ref['eta']:.3f} "
        f"± {ref['eta_mcse']:.3f} from {ref_text}, in {ref['seconds']:.0f} s.",
        "",
        "± are Monte Carlo standard errors (ArviZ's quantile mcse over the chains). Δ LSD++: eta minus "
        "LSD++'s eta at the same participation, in standard errors of the difference of independent runs "
        "(the runs share seed 1, not their draws). Bits / iteration: the kernel's uploaded bits over the "
        "whole run, set-up included, / all iterations; sampling: over the sampling iterations only.",
        "",
        "| sampler | participation | eta_0.05 | relative HPD error | Δ LSD++ (s.e.) | bits / iteration "
        "| relative bit efficiency | sampling bits / iteration | sampling efficiency | step | thinning "
        "| time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sampler']} | {r['participation']} | {r['eta']:.3f} ± {r['eta_mcse']:.3f} | "
            f"{r['relative_hpd_error']:.2e} ± {r['relative_hpd_error_se']:.1e} | "
            f"{'—' if r['sampler'] == 'LSD++' else format(r['eta_minus_lsd_in_se'], '+.1f')} | "
            f"{r['bits_per_iteration']:.0f} | {r['bit_efficiency']:.2f} | "
            f"{r['sampling_bits_per_iteration']:.0f} | {r['sampling_bit_efficiency']:.2f} | "
            f"{r['step_size']:.3g} | {r.get('thinning', 1)} | {r['seconds']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
