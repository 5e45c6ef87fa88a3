r"""Effective draws per second of FALD and VR-FALD⋆ against NUTS on pooled data: tall logistic regression.

What is measured
----------------
Bayesian logistic regression with ``d = 20`` coefficients (an intercept column and 19 standard normal
features), prior :math:`w \sim N(0, I)`, on synthetic data drawn with a fixed seed: ``N = 10^5`` points on
the CPU (``10^6`` with ``--device cuda``), labels :math:`y \sim \mathrm{Bernoulli}(\sigma(x^\top w_0))` with
:math:`w_0 = 0.25 \cdot N(0, I)` and a zero intercept (balanced labels). The data are split into
``b = 100`` i.i.d. clients (:func:`pyro_fed.partition.iid`). The model is written as a user would: the
data plate at full size, read through ``pyro.subsample``; the same model runs under NUTS (on the pooled
data) and under the federated kernels.

1. **Reference**: one long NUTS chain on the pooled data (``--ref-warmup`` + ``--ref-samples`` draws)
   gives the reference posterior mean and sd of every coefficient.
2. **NUTS timed**: an independent NUTS run of ordinary length (500 warm-up + 1000 draws, one chain: Pyro
   runs chains one after another here anyway). ``ESS/s`` = min over the 20 coefficients of ArviZ's bulk
   ESS, divided by the wall time of ``mcmc.run`` **including warm-up** (adaptation is part of the cost
   of NUTS).
3. **FALD family** (``b = 100``): a small grid of :class:`~pyro_fed.FaldKernel` and
   :class:`~pyro_fed.VrFaldKernel` settings. ``ESS/s`` = min bulk ESS (all chains of the run pooled, as
   ArviZ does) divided by the wall time of ``mcmc.run`` **including** the kernel's tracing and
   TorchInductor compilation, and also excluding it (``prep`` column: the kernel's own preparation
   seconds; TorchInductor's on-disk cache, left warm by earlier runs on the machine, shortens it).
   The step sizes are given (below), so the kernels adapt nothing and their "warm-up" is plain burn-in;
   its iterations are in the time.
4. **The kernels at their defaults** (FALD, VR-FALD⋆, QLSD++ — ``control_variate="svrg"`` names it):
   ``Kernel(model, clients)`` with nothing else, 4 chains of 500 warm-up and 1000 draws, as a user runs it;
   the rows list what the warm-up chose (minibatch, step as :math:`hL`, thinning, refreshes). Not run here:
   SGLD (the law of FALD's average at its defaults, at the same cost) and D-ULA on a ring of 100 agents
   (their disagreement forces an automatic step 130 times smaller than SGLD's there, 0.0013 against 0.18,
   with full batches, and the thinning to its cap: hours);
   ``benchmarks/defaults.py`` runs both.
5. **NumPyro's NUTS** on the pooled data, one CPU thread, 500 warm-up + 2000 draws, JIT compilation
   included (when NumPyro is installed: ``pip install numpyro``; ``--no-numpyro`` skips it).

Accuracy check of every run against the reference, per coefficient :math:`j`, reported as the max over
:math:`j`: ``mean err`` = :math:`|\hat\mu_j - \mu^{ref}_j| / \sigma^{ref}_j` (must be ≤ 0.1) and ``sd err``
= :math:`|\hat\sigma_j / \sigma^{ref}_j - 1|` (must be ≤ 0.1). Both include Monte Carlo error of the
run and of the reference (printed: with ESS :math:`E` the mean error has sd :math:`\approx
\sqrt{1/E + 1/E_{ref}}`, and the max over 20 coefficients is about 2.5 times that), so a setting passes
only with enough ESS, as it should.

Step size (pooled information used to *set* it, acceptable for a benchmark): at consensus FALD's client
average is Langevin with step :math:`\gamma / b` on the full potential :math:`U`, so a centralised step
:math:`h` is ``step_size = b * h``. We take :math:`h = c / L` with :math:`L` the largest eigenvalue of the
posterior Hessian :math:`I + X^\top \mathrm{diag}(p(1-p)) X` at the NUTS reference mean (``c`` is the
``hL`` column). On a Gaussian target, Langevin with step :math:`h` inflates the variance along curvature
:math:`\lambda` by :math:`1/(1 - h\lambda/2)` (2.6% in sd at :math:`h\lambda = 0.1`) and its mean's
integrated autocorrelation time is :math:`\approx 2/(h\lambda)` iterations, so :math:`c` trades accuracy
against mixing; the condition number :math:`L/m` of this posterior is printed (the features are
independent, so it is small: Langevin is not preconditioned, and correlated features would cost it a
factor :math:`L/m` in ESS/s that NUTS, with its adapted mass matrix, partly avoids).

Minibatch noise: plain FALD's gradient noise inflates the stationary variance by about
:math:`1 + c\,(N/n - 1)/2` (``n`` = total minibatch over the clients), so plain FALD needs a large fraction
of the data per iteration; VR-FALD⋆'s control variates reduce the noise to the variation of the per-datum
gradients between the iterate and the reference point, a few per mille here even with 10 points per
client. The grid shows both.

Why: the case for federated Langevin on tall data is that an iteration touches a minibatch of each
client, not the whole data; this measures whether, as implemented (compiled chunked iterations, batched
chains), that buys more effective draws per second than the standard sampler on pooled data, at the same
accuracy.

Targets (reported, never asserted): the best hand-tuned FALD-family setting that passes both accuracy
checks has an ESS/s (compilation included) ≥ NUTS's on the CPU (≥ 10× on a GPU); the best kernel at its
defaults within the accuracy checks reaches at least the best hand-tuned ESS/s, and the moonshot, NumPyro's
NUTS — all measured in the same run.

Timing: single-threaded on the CPU by default (``--threads``; the same for NUTS and the kernels; with a
busy 2-core machine, two threads per process make small tensor operations much slower through thread
contention). The load average is recorded with every run. The whole CPU run takes about 8-10 minutes.

Run from the repository root::

    python benchmarks/tall_logistic.py                 # CPU, N = 10^5 (~10 min)
    python benchmarks/tall_logistic.py --quick         # smoke run, N = 10^4, short chains (~1-2 min)
    python benchmarks/tall_logistic.py --device cuda   # GPU, N = 10^6

Results: ``benchmarks/results/tall_logistic{_quick,_cuda}.{json,md}`` (``--out`` changes the folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS

import pyro_fed

RESULTS = Path(__file__).resolve().parent / "results"
DIM = 20
NUM_CLIENTS = 100
DATA_SEED = 0
TOLERANCE = 0.1  # max mean error (in reference sds) and max relative sd error


# --------------------------------------------------------------------------------------------- problem
def model(x, y=None):
    """Bayesian logistic regression, w ~ N(0, I); the data plate at full size, read through its indices."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y",
            dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w),
            obs=pyro.subsample(y, event_dim=0),
        )


def make_data(num_data: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features (intercept + 19 standard normals), labels and the true coefficients, drawn on the CPU with
    a fixed seed (the same data on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(num_data, DIM, generator=generator)
    x[:, 0] = 1.0
    w_true = 0.25 * torch.randn(DIM, generator=generator)
    w_true[0] = 0.0
    y = torch.bernoulli(torch.sigmoid(x @ w_true), generator=generator)
    return x.to(device), y.to(device), w_true


def curvature(x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Largest and smallest eigenvalues of the posterior Hessian ``I + X^T diag(p(1-p)) X`` at ``w``."""
    x64 = x.double()
    p = torch.sigmoid(x64 @ w.to(x64))
    hessian = (x64 * (p * (1 - p))[:, None]).T @ x64 + torch.eye(x.shape[1], dtype=x64.dtype, device=x.device)
    eigenvalues = torch.linalg.eigvalsh(hessian)
    return float(eigenvalues[-1]), float(eigenvalues[0])


# --------------------------------------------------------------------------------------------- helpers
def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def draws_by_chain(mcmc: MCMC) -> np.ndarray:
    """``[chains, draws, d]`` float64 draws of ``w``."""
    return mcmc.get_samples(group_by_chain=True)["w"].detach().double().cpu().numpy()


def ess_bulk(draws: np.ndarray) -> np.ndarray:
    """ArviZ's bulk ESS per coordinate of ``[chains, draws, d]`` draws."""
    dataset = az.convert_to_dataset({"w": draws})
    return np.asarray(az.ess(dataset, method="bulk")["w"].values)


def accuracy(draws: np.ndarray, reference: dict) -> dict:
    flat = draws.reshape(-1, draws.shape[-1])
    mean, sd = flat.mean(0), flat.std(0, ddof=1)
    ref_mean, ref_sd = np.asarray(reference["mean"]), np.asarray(reference["sd"])
    mean_err = np.abs(mean - ref_mean) / ref_sd
    sd_err = np.abs(sd / ref_sd - 1)
    return {
        "max_mean_err": float(mean_err.max()),
        "max_sd_err": float(sd_err.max()),
        "mean_sd_ratio": float((sd / ref_sd).mean()),
        "mean_ok": bool(mean_err.max() <= TOLERANCE),
        "sd_ok": bool(sd_err.max() <= TOLERANCE),
    }


def mc_scale(ess: float, reference: dict) -> float:
    """The size of the max over the coefficients of the mean error (in sds) from Monte Carlo error alone:
    about 2.5 standard deviations of ``sqrt(1/ESS + 1/ESS_ref)`` (the max of 20 half-normals)."""
    return 2.5 * math.sqrt(1 / ess + 1 / reference["min_ess_bulk"])


def run_nuts(x, y, warmup: int, samples: int, seed: int, device: str) -> tuple[MCMC, float, float]:
    pyro.set_rng_seed(seed)
    mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=warmup, disable_progbar=True)
    synchronize(device)
    start_load = load()
    start = time.perf_counter()
    mcmc.run(x, y)
    synchronize(device)
    return mcmc, time.perf_counter() - start, start_load


def nuts_reference(x, y, args) -> tuple[dict, float, float]:
    """The long NUTS run: reference means and sds, and the curvature at the reference mean."""
    mcmc, wall, start_load = run_nuts(x, y, args.ref_warmup, args.ref_samples, 1000 + args.seed, args.device)
    draws = draws_by_chain(mcmc)
    flat = draws.reshape(-1, DIM)
    reference = {
        "mean": flat.mean(0).tolist(),
        "sd": flat.std(0, ddof=1).tolist(),
        "min_ess_bulk": float(ess_bulk(draws).min()),
        "warmup": args.ref_warmup,
        "samples": args.ref_samples,
        "wall_s": wall,
        "load": start_load,
    }
    lipschitz, smallest = curvature(x, torch.as_tensor(reference["mean"], device=x.device))
    print(
        f"reference NUTS: {wall:.0f} s, min bulk ESS {reference['min_ess_bulk']:.0f}; posterior Hessian "
        f"at its mean: L = {lipschitz:.4g}, m = {smallest:.4g}, L/m = {lipschitz / smallest:.3f}",
        flush=True,
    )
    return reference, lipschitz, smallest


def numpyro_model(x, y=None):
    """The same model in NumPyro (imported only when its row is run)."""
    import numpyro
    import numpyro.distributions as ndist

    w = numpyro.sample("w", ndist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    numpyro.sample("y", ndist.Bernoulli(logits=x @ w), obs=y)


def numpyro_timed(x, y, args, reference: dict) -> dict | None:
    """NumPyro's NUTS on the pooled data on one CPU thread (500 warm-up + 2000 draws, JIT compilation
    included): the fastest NUTS there is on a CPU, the moonshot of the defaults. ``None`` without NumPyro
    (``pip install numpyro``)."""
    # one thread for XLA too, set before JAX starts
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    try:
        import jax
        import numpyro
        from numpyro.infer import MCMC as NumPyroMCMC
        from numpyro.infer import NUTS as NumPyroNUTS
    except ImportError:
        print("NumPyro not installed: its row is skipped (pip install numpyro)", flush=True)
        return None
    warmup, samples = 500, max(100, int(2000 * args.length))
    xj, yj = jax.numpy.asarray(x.cpu().numpy()), jax.numpy.asarray(y.cpu().numpy())
    mcmc = NumPyroMCMC(NumPyroNUTS(numpyro_model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    start_load = load()
    start = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(args.seed), xj, yj)
    draws = np.asarray(mcmc.get_samples()["w"])  # waits for the device
    wall = time.perf_counter() - start
    draws = draws[None].astype(np.float64)
    ess = float(ess_bulk(draws).min())
    print(f"NumPyro NUTS: {wall:.1f} s, min bulk ESS {ess:.0f}, ESS/s {ess / wall:.3g}", flush=True)
    settings = f"{warmup} warm-up + {samples} draws, JIT included, numpyro {numpyro.__version__}"
    return nuts_row(
        "NumPyro NUTS (pooled data)", "NumPyro NUTS", settings, draws, wall, start_load, reference
    )


def nuts_row(name, kernel, settings, draws, wall, start_load, reference, **extra) -> dict:
    """A row of a NUTS run on the pooled data (one chain, nothing to prepare)."""
    ess = float(ess_bulk(draws).min())
    return {
        "name": name,
        "kernel": kernel,
        "settings": settings,
        "chains": 1,
        "wall_s": wall,
        "prep_s": 0.0,
        "min_ess_bulk": ess,
        "ess_per_s": ess / wall,
        "ess_per_s_excl_prep": ess / wall,
        "load": start_load,
        "mc_scale": mc_scale(ess, reference),
        "predicted_sd_ratio": 1.0,
        **extra,
        **accuracy(draws, reference),
    }


def nuts_timed(x, y, args, reference: dict) -> dict:
    """NUTS of ordinary length, timed: its row of the table."""
    mcmc, wall, start_load = run_nuts(x, y, args.nuts_warmup, args.nuts_samples, args.seed, args.device)
    settings = f"{args.nuts_warmup} warm-up + {args.nuts_samples} draws, adapted diagonal mass"
    row = nuts_row(
        "NUTS (pooled data)", "NUTS", settings, draws_by_chain(mcmc), wall, start_load, reference,
        step_size=float(mcmc.kernel.step_size),
    )  # fmt: skip
    ess = row["min_ess_bulk"]
    print(f"NUTS: {wall:.1f} s, min bulk ESS {ess:.0f}, ESS/s {row['ess_per_s']:.3g}", flush=True)
    return row


# --------------------------------------------------------------------------------------------- settings
def settings(args) -> list[dict]:
    """The FALD-family grid. ``c`` = hL; each chain runs ``(burn_in + draws) * thinning`` iterations.
    Lengths aim at a pooled min bulk ESS of ~2000 where affordable (then the 0.1-sd accuracy check is
    decided by the bias, not by Monte Carlo error). ``chunk_size`` 200 is a multiple of a client's
    minibatches per local epoch (1000 / 10), so the minibatch sampler's permutations are used in full."""
    if args.grid is not None:
        grid = json.loads(args.grid)
    else:
        common = {"thinning": 10, "chunk_size": 200, "gradient_mode": "compiled"}

        def fald(batch_size, c, comm_prob, chains, draws):
            return dict(kernel="FALD", batch_size=batch_size, c=c, comm_prob=comm_prob, **common,
                        chains=chains, draws=draws)  # fmt: skip

        def vr(c, refresh_prob, chains, draws):
            return dict(kernel="VR-FALD*", batch_size=10, c=c, comm_prob=0.2, refresh_prob=refresh_prob,
                        **common, chains=chains, draws=draws)  # fmt: skip

        grid = [
            # plain FALD, 10 points per client: cheap iterations; the minibatch noise inflates the sds, and
            # with p_c < 1 the clients drift toward their own local posteriors between averaging rounds
            fald(10, 0.1, 0.2, chains=4, draws=500),
            fald(10, 0.1, 1.0, chains=4, draws=500),  # no drift: only the minibatch noise is left
            # plain FALD with half of each client's data per iteration and no drift: expensive iterations
            fald("half", 0.1, 1.0, chains=1, draws=250),
            # VR-FALD*: 10 points per client with control variates, refreshed with probability q_c
            vr(0.1, 0.005, chains=1, draws=4000),
            vr(0.15, 0.005, chains=1, draws=3500),
            vr(0.15, 0.002, chains=1, draws=3500),
            vr(0.2, 0.002, chains=1, draws=2500),  # larger step: sd bias ~5% (top curvature), marginal
            vr(0.15, 0.005, chains=4, draws=900),  # chains batched in one process
        ]
        if args.device.startswith("cuda"):  # on a GPU, many batched chains cost little more than one
            # a burn-in of three refreshes: until the first, the control variates are taken at the start,
            # far from the posterior (the first H200 run burnt in 30 draws, 300 iterations: sds 2.4x)
            grid.append({**vr(0.15, 0.002, chains=16, draws=300), "burn_in": 150})
    for s in grid:
        s["draws"] = max(50, int(s["draws"] * args.length))
        s.setdefault("burn_in", max(10, s["draws"] // 10))  # plain burn-in: FALD adapts nothing
    return grid


def batch_size(setting: dict, num_data: int) -> int:
    """Minibatch size per client; ``"half"``: half of a client's data."""
    if setting["batch_size"] == "half":
        return num_data // NUM_CLIENTS // 2
    return int(setting["batch_size"])


def predicted_sd_ratio(setting: dict, num_data: int) -> float:
    """Stationary sd / posterior sd along the top curvature ``L`` for a Gaussian target: Langevin's
    discretisation ``1 / (1 - c/2)`` in variance, times ``1 + c (N/n - 1)/2`` for plain FALD's minibatch
    noise (``n`` points per iteration over all clients, drawn without replacement within each client; the
    control variates of VR-FALD* leave a negligible ``~ c d / (2 n)``). At the defaults: the automatic
    step's design, ``sqrt(1 + 0.1)`` along the stiffest preconditioned direction, step and noise together."""
    if setting.get("defaults"):
        return math.sqrt(1 + pyro_fed.algorithms.adaptation.VARIANCE_TARGET)
    c = setting["c"]
    variance = 1 / (1 - c / 2)
    if setting["kernel"] == "FALD":
        n = NUM_CLIENTS * batch_size(setting, num_data)
        variance *= 1 + c * (num_data / n - 1) / 2
    return math.sqrt(variance)


#: the kernels at their defaults: ``Kernel(model, clients)``, with the options that name the algorithm
#: (QLSD++'s control variate). Not here: SGLD on the pooled data (the law of FALD's average at its
#: defaults, at the same cost per iteration) and D-ULA (on its default ring of 100 agents each agent sits
#: sqrt(2 alpha n) posterior sds from the average, and its data pull it toward its own posterior: the
#: automatic step is 130 times smaller than SGLD's, with full batches: one run of this protocol would take
#: hours; see
#: ``benchmarks/defaults.py`` for both on smaller models)
DEFAULT_KERNELS = {
    "FALD": (pyro_fed.FaldKernel, {}),
    "VR-FALD*": (pyro_fed.VrFaldKernel, {}),
    "QLSD++": (pyro_fed.QlsdKernel, {"control_variate": "svrg"}),
}


def defaults_settings(args) -> list[dict]:
    """One row per kernel at its defaults, as a user runs it: 4 chains of 500 warm-up and 1000 draws (the
    thinning, the step, the minibatch and the refreshes chosen by the warm-up)."""
    draws = max(50, int(1000 * args.length))
    return [
        dict(kernel=name, defaults=True, chains=4, draws=draws, burn_in=draws // 2)
        for name in DEFAULT_KERNELS
    ]


def make_kernel(setting: dict, clients, lipschitz: float, num_data: int):
    """The setting's kernel: at its defaults, or the hand-tuned FALD / VR-FALD⋆ of the grid."""
    if setting.get("defaults"):
        kernel_class, options = DEFAULT_KERNELS[setting["kernel"]]
        return kernel_class(model, clients, **options)
    kernel_class = pyro_fed.FaldKernel if setting["kernel"] == "FALD" else pyro_fed.VrFaldKernel
    extra = {"refresh_prob": setting["refresh_prob"]} if "refresh_prob" in setting else {}
    return kernel_class(
        model,
        clients,
        step_size=NUM_CLIENTS * setting["c"] / lipschitz,
        batch_size=batch_size(setting, num_data),
        comm_prob=setting["comm_prob"],
        thinning=setting["thinning"],
        chunk_size=setting.get("chunk_size", 64),
        gradient_mode=setting.get("gradient_mode", "compiled"),
        **extra,
    )


def chosen_settings(kernel, lipschitz: float) -> dict:
    """What a kernel at its defaults chose: its step as h L (h the move on U per iteration: gamma / b for the
    clients' average, gamma for a server or a single agent), minibatch, thinning, refreshes."""
    pot = kernel.potential
    step = kernel.current_step_size
    server = kernel.settings.server_step or pot.num_clients == 1
    per_iteration = step if server or isinstance(kernel, pyro_fed.DulaKernel) else step / pot.num_clients
    chosen = {
        "c": per_iteration * lipschitz * _preconditioned_scale(kernel),
        "batch_size": kernel.current_batch_size or "full",
        "thinning": kernel.current_thinning,
    }
    if isinstance(kernel, pyro_fed.VrFaldKernel):
        chosen["refresh_prob"] = kernel.current_refresh_prob
    if isinstance(kernel, pyro_fed.QlsdKernel) and kernel.control_variate == "svrg":
        chosen["snapshot_every"] = kernel.algorithm.snapshot_every
    return chosen


def _preconditioned_scale(kernel) -> float:
    """The inverse mass along the posterior's stiffest direction, so that ``h L`` compares with an
    unpreconditioned step (the preconditioner here is close to a multiple of the identity: the features are
    independent)."""
    inverse_mass = kernel.adaptation.preconditioner
    return float((inverse_mass if inverse_mass.dim() == 1 else inverse_mass.diagonal()).mean())


def run_federated(setting: dict, x, y, clients, lipschitz: float, seed: int, device: str) -> dict:
    kernel = make_kernel(setting, clients, lipschitz, x.shape[0])
    pyro.set_rng_seed(seed)
    mcmc = MCMC(
        kernel,
        num_samples=setting["draws"],
        warmup_steps=setting["burn_in"],
        num_chains=setting["chains"],
        disable_progbar=True,
    )
    synchronize(device)
    start_load = load()
    start = time.perf_counter()
    mcmc.run(x, y)
    synchronize(device)
    wall = time.perf_counter() - start
    prep = kernel.preparation_seconds
    diagnostics = mcmc.diagnostics()
    divergences = sum(len(v) for v in diagnostics["divergences"].values())
    result = {
        "mcmc": mcmc,
        "wall": wall,
        "prep": prep,
        "step_size": kernel.current_step_size,
        "divergences": divergences,
        "load": start_load,
        "iterations_per_chain": (setting["draws"] + setting["burn_in"]) * kernel.current_thinning,
        "warnings": kernel.end_of_run_checks["problems"],
    }
    if setting.get("defaults"):
        result["chosen"] = chosen_settings(kernel, lipschitz)
    return result


# --------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 10^4, short chains")
    parser.add_argument("--device", default="cpu", help="cpu (N = 10^5) or cuda (N = 10^6)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--num-data", type=int, default=None, help="override N")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--ref-warmup", type=int, default=500)
    parser.add_argument("--ref-samples", type=int, default=2500)
    parser.add_argument("--nuts-warmup", type=int, default=500)
    parser.add_argument("--nuts-samples", type=int, default=1000)
    parser.add_argument("--length", type=float, default=1.0, help="scale the FALD-family run lengths")
    parser.add_argument("--grid", type=str, default=None, help="JSON list of settings replacing the grid")
    parser.add_argument("--only", type=str, default=None, help="comma-separated grid rows to run (0-based)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--no-numpyro", dest="numpyro", action="store_false", help="skip NumPyro's NUTS even when installed"
    )
    parser.add_argument(
        "--reuse-reference", type=Path, default=None, help="take the reference and NUTS rows from this JSON"
    )
    args = parser.parse_args(argv)
    args.command = " ".join(sys.argv[1:] if argv is None else argv)
    cuda = args.device.startswith("cuda")
    if args.num_data is None:
        args.num_data = 10**4 if args.quick else (10**6 if cuda else 10**5)
    if args.quick:
        args.ref_warmup, args.ref_samples = 200, 500
        args.nuts_warmup, args.nuts_samples = 200, 300
        args.length = min(args.length, 0.2)
    return args


def fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}g}"


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    started = time.perf_counter()
    x, y, w_true = make_data(args.num_data, args.device)
    clients = pyro_fed.partition.iid(args.num_data, NUM_CLIENTS, seed=DATA_SEED)
    print(
        f"N = {args.num_data}, d = {DIM}, b = {NUM_CLIENTS}, device {args.device}, "
        f"threads {torch.get_num_threads()}, labels mean {float(y.mean()):.3f}",
        flush=True,
    )

    if args.reuse_reference is not None:  # exploration: the reference and NUTS rows of an earlier run
        previous = json.loads(args.reuse_reference.read_text())
        reference, rows = previous["reference"], [previous["rows"][0]]
        lipschitz, smallest = previous["problem"]["L"], previous["problem"]["m"]
        nuts_row = rows[0]
    else:
        reference, lipschitz, smallest = nuts_reference(x, y, args)
        nuts_row = nuts_timed(x, y, args, reference)
        rows = [nuts_row]

    # ------------------------------------------------------------------ NumPyro (when installed)
    if args.numpyro and args.reuse_reference is None and not args.device.startswith("cuda"):
        numpyro_row = numpyro_timed(x, y, args, reference)
        if numpyro_row is not None:
            rows.append(numpyro_row)

    def save(finished: bool) -> None:  # after every row: a run stopped early keeps what it measured
        total = time.perf_counter() - started
        verdict = verdicts(args, rows, nuts_row)
        write(args, rows, reference, verdict, lipschitz, smallest, w_true, total, finished)

    # ------------------------------------------------------------------ the kernels
    grid = settings(args) + defaults_settings(args)
    chosen = range(len(grid)) if args.only is None else [int(i) for i in args.only.split(",")]
    for index in chosen:
        setting = grid[index]
        result = run_federated(setting, x, y, clients, lipschitz, args.seed + index, args.device)
        draws = draws_by_chain(result["mcmc"])
        ess = float(ess_bulk(draws).min())
        wall, prep = result["wall"], result["prep"]
        runs = f"{setting['chains']} chain(s) × ({setting['burn_in']} burn-in + {setting['draws']}) draws"
        if setting.get("defaults"):
            picked = result["chosen"]
            setting = {**setting, **picked}
            described = (
                f"**defaults**: chose bs {picked['batch_size']}/client, hL {picked['c']:.3g}, thin "
                f"{picked['thinning']}"
                + (f", q_c {picked['refresh_prob']:.2g}" if "refresh_prob" in picked else "")
                + (f", l {picked['snapshot_every']}" if "snapshot_every" in picked else "")
                + f"; {runs}"
            )
        else:
            described = (
                f"bs {batch_size(setting, args.num_data)}/client, hL {setting['c']:g}, "
                f"p_c {setting['comm_prob']:g}"
                + (f", q_c {setting['refresh_prob']:g}" if "refresh_prob" in setting else "")
                + f", thin {setting['thinning']}, {runs}"
            )
        row = {
            "name": f"{setting['kernel']} #{index}",
            "kernel": setting["kernel"],
            "settings": described,
            **{k: v for k, v in setting.items() if k != "kernel"},
            "step_size": result["step_size"],
            "iterations_per_chain": result["iterations_per_chain"],
            "wall_s": wall,
            "prep_s": prep,
            "ms_per_iteration_excl_prep": 1e3 * (wall - prep) / result["iterations_per_chain"],
            "min_ess_bulk": ess,
            "ess_per_s": ess / wall,
            "ess_per_s_excl_prep": ess / max(wall - prep, 1e-9),
            "divergences": result["divergences"],
            "load": result["load"],
            "mc_scale": mc_scale(ess, reference),
            "predicted_sd_ratio": predicted_sd_ratio(setting, args.num_data),
            "end_of_run_problems": result["warnings"],
            **accuracy(draws, reference),
        }
        rows.append(row)
        save(finished=False)
        print(
            f"{row['name']}: {described}: {wall:.1f} s (prep {prep:.1f} s), min ESS {ess:.0f}, "
            f"ESS/s {row['ess_per_s']:.3g} ({row['ess_per_s_excl_prep']:.3g} excl. prep), "
            f"mean err {row['max_mean_err']:.3f}, sd err {row['max_sd_err']:.3f}",
            flush=True,
        )
    save(finished=True)


def verdicts(args, rows: list[dict], nuts_row: dict) -> str:
    """The targets, each with its verdict: the best accurate hand-tuned setting against NUTS (≥ 1× on the
    CPU, 10× on a GPU), and the best accurate kernel at its defaults against the best hand-tuned one and
    NumPyro's NUTS, all measured in this run."""
    factor = 10.0 if args.device.startswith("cuda") else 1.0
    kernels = [r for r in rows[1:] if r["kernel"] != "NumPyro NUTS"]
    passing = [r for r in kernels if r["mean_ok"] and r["sd_ok"]]
    tuned = max((r for r in passing if not r.get("defaults")), key=lambda r: r["ess_per_s"], default=None)
    default = max((r for r in passing if r.get("defaults")), key=lambda r: r["ess_per_s"], default=None)
    lines = []
    if tuned is None:
        lines.append(
            f"hand-tuned ≥ {factor:g}× NUTS: **NOT met** — no hand-tuned setting passed both checks."
        )
    else:
        ratio = tuned["ess_per_s"] / nuts_row["ess_per_s"]
        lines.append(
            f"hand-tuned ≥ {factor:g}× NUTS (compilation included): {tuned['name']} reaches "
            f"{tuned['ess_per_s']:.3g} ESS/s = {ratio:.2f}× NUTS's {nuts_row['ess_per_s']:.3g} — "
            f"**{'met' if ratio >= factor else 'NOT met'}**."
        )
    if default is None:
        lines.append("defaults ≥ hand-tuned: **NOT met** — no kernel at its defaults passed both checks.")
    else:
        line = f"defaults ≥ hand-tuned: {default['name']} at its defaults: {default['ess_per_s']:.3g} ESS/s"
        if tuned is not None:
            ratio = default["ess_per_s"] / tuned["ess_per_s"]
            line += f" = {ratio:.2f}× the best hand-tuned — **{'met' if ratio >= 1 else 'NOT met'}**"
        numpyro = next((r for r in rows if r["kernel"] == "NumPyro NUTS"), None)
        if numpyro is not None:
            ratio = default["ess_per_s"] / numpyro["ess_per_s"]
            line += (
                f"; {ratio:.2f}× NumPyro's NUTS ({numpyro['ess_per_s']:.3g} ESS/s, the moonshot) — "
                f"**{'met' if ratio >= 1 else 'NOT met'}**"
            )
        lines.append(line + ".")
    return " ".join(lines)


def write(args, rows, reference, verdict, lipschitz, smallest, w_true, total, finished: bool) -> None:
    cuda = args.device.startswith("cuda")
    suffix = "_quick" if args.quick else ("_cuda" if cuda else "")
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "arviz": az.__version__,
        "pyro_fed": pyro_fed.__version__,
        "numpy": np.__version__,
    }
    date = datetime.date.today().isoformat()
    header = (
        f"Bayesian logistic regression, d = {DIM} (intercept + 19 N(0,1) features), prior N(0, I), "
        f"N = {args.num_data} synthetic points (seed {DATA_SEED}), b = {NUM_CLIENTS} iid clients; "
        f"device {args.device} ({device_name}), {torch.get_num_threads()} torch thread(s), "
        f"{os.cpu_count()} CPUs; {date}."
    )
    table = [
        "| run | settings | chains | wall s | prep s | min bulk ESS | ESS/s | ESS/s excl. prep | "
        "max mean err (sd) | MC scale | max sd err | sd ratio | predicted | accurate | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in rows:
        ok = "yes" if r["mean_ok"] and r["sd_ok"] else ("no (mean)" if not r["mean_ok"] else "no (sd)")
        if not r["mean_ok"] and not r["sd_ok"]:
            ok = "no (both)"
        table.append(
            f"| {r['name']} | {r['settings']} | {r['chains']} | {r['wall_s']:.1f} | {r['prep_s']:.1f} | "
            f"{r['min_ess_bulk']:.0f} | {r['ess_per_s']:.3g} | {r['ess_per_s_excl_prep']:.3g} | "
            f"{r['max_mean_err']:.3f} | {r['mc_scale']:.3f} | {r['max_sd_err']:.3f} | "
            f"{r['mean_sd_ratio']:.3f} | {r['predicted_sd_ratio']:.3f} | {ok} | {r['load']:.1f} |"
        )
    ms = [
        f"- {r['name']}: step_size γ = {r['step_size']:.4g} (h L = {r['c']:.3g}, h the move on U per "
        f"iteration), {r['ms_per_iteration_excl_prep']:.3g} ms per iteration (all chains, compilation "
        f"excluded), {r['divergences']} divergent draws"
        + (f"; end of run: {'; '.join(r['end_of_run_problems'])}" if r.get("end_of_run_problems") else "")
        for r in rows[1:]
        if "step_size" in r
    ]
    md = [
        f"# Tall logistic regression: ESS/s of FALD / VR-FALD⋆ (b = {NUM_CLIENTS}) vs NUTS on pooled data",
        "",
        f"Generated by `python benchmarks/tall_logistic.py {args.command}".rstrip()
        + "` (see its docstring for what is measured)."
        + ("" if finished else f" **Partial**: the run stopped after these {len(rows)} rows."),
        "",
        header,
        "",
        f"Reference: NUTS, 1 chain, {reference['warmup']} warm-up + {reference['samples']} draws "
        f"({reference['wall_s']:.0f} s, min bulk ESS {reference['min_ess_bulk']:.0f}). Posterior Hessian at "
        f"the reference mean: L = {lipschitz:.4g}, m = {smallest:.4g} (L/m = {lipschitz / smallest:.3f}); "
        "the kernels' step sizes are set from L (pooled information, used only to set the step).",
        "",
        "ESS/s = min over the 20 coefficients of ArviZ bulk ESS (chains pooled) / wall time of `mcmc.run` "
        "(NUTS: warm-up included; FALD family: burn-in and compilation included, `prep` = tracing + "
        "compilation seconds). Accuracy: max over coefficients of |mean − ref mean| / ref sd and "
        f"|sd / ref sd − 1|, both must be ≤ {TOLERANCE:g}. `MC scale` = 2.5·sqrt(1/ESS + 1/ESS_ref), the "
        "size of the max mean error expected from Monte Carlo error alone (a row whose mean error is far "
        "above it is biased; one with MC scale near 0.1 cannot pass reliably whatever its bias). `sd ratio` "
        "= mean over coefficients of sd / ref sd; `predicted` = the sd ratio along the top curvature "
        "predicted for a Gaussian target by the step (Langevin discretisation) and, for plain FALD, the "
        "minibatch noise (see the script's docstring); at the defaults, the automatic step's design "
        "(sqrt(1.1)). The hand-tuned kernels run with `gradient_mode='compiled'`, `chunk_size=200`, "
        "`noise_corr=1`, the default prior weights, init at the prior median (w = 0); the **defaults** rows "
        "are `Kernel(model, clients)` with nothing else (QLSD++: `control_variate='svrg'`), their choices "
        "listed. `load` = 1-minute load average at the start of the run.",
        "",
        *table,
        "",
        *ms,
        "",
        f"Verdict: {verdict}",
        "",
        f"Whole run: {total:.0f} s. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; {platform.platform()}.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"tall_logistic{suffix}.md").write_text("\n".join(md) + "\n")
    payload = {
        "problem": {
            "num_data": args.num_data,
            "dim": DIM,
            "num_clients": NUM_CLIENTS,
            "prior": "N(0, I)",
            "data_seed": DATA_SEED,
            "w_true": w_true.tolist(),
            "L": lipschitz,
            "m": smallest,
        },
        "reference": reference,
        "rows": rows,
        "verdict": verdict,
        "tolerance": TOLERANCE,
        "wall_seconds": total,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "versions": versions,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": args.device,
            "device_name": device_name,
            "threads": torch.get_num_threads(),
        },
        "date": date,
        "command": f"tall_logistic.py {args.command}".rstrip(),
        "finished": finished,
    }
    (args.out / f"tall_logistic{suffix}.json").write_text(json.dumps(payload, indent=1))
    print("\n".join(md) if finished else f"(saved the {len(rows)} rows so far)", flush=True)


if __name__ == "__main__":
    main()
