r"""FALD vs VR-FALD⋆ under client heterogeneity: the FALD paper's Gaussian experiment (its Table 1).

What is measured
----------------
``b = 100`` clients with Gaussian potentials :math:`U^i(x) = \frac12 (x - \mu_i)^\top \Sigma_i^{-1}
(x - \mu_i)` in dimension ``d = 2`` (``--dim 4`` also works), drawn by
:func:`pyro_fed.testing.heterogeneous_gaussian_clients` as in the authors' code for the paper's Section 5:
:math:`\mu_i = s \cdot N(0, I)` with ``s = mean_scale = 10``, :math:`\Sigma_i` random rotated 2×2 blocks
scaled by :math:`c_i \sim U(0.1, 10.1)`. The target :math:`\pi \propto \exp(-\sum_i U^i)` is Gaussian and
known exactly (:meth:`~pyro_fed.testing.GaussianClients.posterior`): :math:`x_\star` is its mean (= its
mode) and :math:`\sigma_\star^2 = \int \|x - x_\star\|^2 d\pi` the trace of its covariance.

For each configuration :math:`(p_c, \gamma, \tau)` both samplers are run with **full local batches** and
the exact analytic client gradients :math:`A_i (x - \mu_i)` (the paper's setting), through the library's
pure algorithms -- :func:`pyro_fed.algorithms.fald.step` and :func:`pyro_fed.algorithms.vr_fald.step`
(and :func:`~pyro_fed.algorithms.vr_fald.refresh`) with :class:`~pyro_fed.algorithms.rng.Randomness` and
:class:`~pyro_fed.communication.InProcessNetwork`,
exactly the updates the Pyro kernels run (the FALD paper's Sections 2 and 3); VR-FALD⋆ uses :math:`q_c = p_c`.
Each chain starts with every client (and VR-FALD⋆'s reference point) at :math:`x_\star`, runs :math:`k_1`
iterations, discards :math:`k_0 = k_1/10`, and estimates

.. math::  \hat\sigma^2 = (k_1 - k_0)^{-1} \textstyle\sum_{k > k_0} \|\bar X_k - x_\star\|^2 .

Per configuration and algorithm the table reports, over the chains,
``MSE`` = mean of :math:`(\hat\sigma^2 - \sigma_\star^2)^2` = ``bias²`` + ``var`` with ``bias`` = mean of
:math:`\hat\sigma^2 - \sigma_\star^2` and ``var`` the spread of :math:`\hat\sigma^2` across chains
(the paper's Table 1 statistic), and the **exact stationary bias**
:math:`E_\infty\|\bar X - x_\star\|^2 - \sigma_\star^2` of the discretised chain, computed without any
simulation from the exact stationary law of the chain (on Gaussian targets both samplers are random linear
recursions; :func:`pyro_fed.testing.fald_stationary_law`,
:func:`~pyro_fed.testing.vr_fald_stationary_law`). The measured bias tends to the exact bias as
:math:`k_1 \to \infty`; comparing the two (column ``z``) checks the implementation. With a start at
:math:`x_\star` and 10% burn-in, a small transient remains in the measured bias of the slowest
configurations (:math:`p_c = 0.1`, factor 0.02: the consensus relaxes in ~500 iterations).

Mapping to the paper
--------------------
Section 5 ("Gaussian posterior") of Plassier et al. (AISTATS 2023) runs 100 chains of :math:`10^7`
iterations per configuration and reports the MSE above in its Table 1 for several :math:`(p_c, \gamma,
\tau)`, stating (1) VR-FALD⋆ beats FALD for every :math:`(p_c, \gamma)`, which it attributes to client
heterogeneity, and (3) VR-FALD⋆'s asymptotic bias improves at :math:`\tau = 1`. This script adds (2): a
sweep of the heterogeneity (``mean_scale`` ∈ {0, 1, 3, 10}, same covariances) at one configuration.

Step sizes follow the authors' code: :math:`\gamma = \text{factor} \cdot p_c \cdot b \cdot \gamma_0` with
:math:`\gamma_0 = 2 / (L + m)`, :math:`L, m` the extreme eigenvalues of the posterior precision
:math:`\sum_i A_i` (so at consensus the step on :math:`U` is :math:`\gamma / b = \text{factor}\cdot p_c
\cdot \gamma_0`). The paper's appendix with the factor values (its Section 10.1) and Table 1 itself are
missing from the extracted text this project has, so the factors here are our choice: ``0.02`` and
``0.1``. They are bounded by mean-square stability, not by the consensus step: between two communications
a client with a large local curvature takes unstable local steps (:math:`\gamma \lambda_{\max}(A_i) > 2`),
which the averaging must catch in time; for this client draw ``factor = 0.3`` is already mean-square
unstable at :math:`p_c = 0.5` (the exact solver reports it, and the chains diverge).

Budget: the paper's :math:`10^7 \times 100` per configuration is ~10^4 times what a few minutes on two CPU
cores allow. The default run uses fewer iterations (printed and stored in the JSON); the exact bias is
unaffected by that and is what claim (3) is judged on, the MSE by the simulations.

How (and one caveat)
--------------------
Chains run batched: a group of ``C`` chains is one call of the library's step on a ``[b, C·d]`` state (the
chains are laid side by side in the parameter dimension; the Gaussian noise, the averaging and the gradient
act coordinate-block-wise, so each block is exactly one chain). The **communication and refresh coins are
one per step, so the chains of a group share them**; groups use different seeds. The mean over chains of
the squared error is still an unbiased estimate of a single chain's MSE, but chains of one group are not
independent: the ``±`` columns are standard errors computed from the spread of the group means (``G``
groups), which accounts for it. FALD and VR-FALD⋆ of one configuration and group use the same seed, so
they see the same Gaussian noise (common random numbers; their coin streams differ); the same seeds serve
every configuration, so the rows' Monte Carlo errors are correlated (the verdicts' counts are not
independent trials). With ``G = 4`` groups the standard errors have 3 degrees of freedom: ``|z|`` up to
about 3 is unremarkable. With :math:`p_c = 1` and full batches the two algorithms are the same Markov
chain (the control variate cancels exactly at consensus), so those rows are a control: their ratio must
be 1. Likewise, with full batches VR-FALD⋆'s recursion written in :math:`X - x_\star` does not involve
the client means at all (its shift is :math:`C = \bar A (Y - x_\star)`), so its sweep rows are one chain
for every ``mean_scale``, while FALD's client drift :math:`A_i (x_\star - \mu_i)` grows with it.

Float32 dynamics (the noise generation dominates the cost and is 5× faster than in float64), float64
statistics and exact laws; single-threaded worker processes (``--workers``).

Run from the repository root::

    python benchmarks/gaussian_heterogeneity.py           # default run (~4 min on 2 idle cores)
    python benchmarks/gaussian_heterogeneity.py --quick   # smoke run (seconds)

Results: ``benchmarks/results/gaussian_heterogeneity.{md,json,png}`` (``gaussian_heterogeneity_quick.*``
with ``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from pyro_fed import testing
from pyro_fed.algorithms import fald, vr_fald
from pyro_fed.algorithms.langevin import client_noise
from pyro_fed.engine.randomness import Randomness
from pyro_fed.network.in_process import InProcessNetwork

RESULTS = Path(__file__).resolve().parent / "results"
NUM_CLIENTS = 100
CLIENT_SEED = 0
ALGORITHMS = ("fald", "vr_fald")
LABEL = {"fald": "FALD", "vr_fald": "VR-FALD⋆"}


# ------------------------------------------------------------------------------------------- problem
@functools.cache
def problem(dim: int, mean_scale: float) -> dict:
    """Clients, exact posterior, :math:`x_\\star`, :math:`\\sigma_\\star^2` and :math:`\\gamma_0`."""
    clients = testing.heterogeneous_gaussian_clients(
        NUM_CLIENTS, dim, mean_scale=mean_scale, seed=CLIENT_SEED
    )
    mean, cov = clients.posterior()
    eigenvalues = torch.linalg.eigvalsh(clients.precisions.sum(0))
    big, small = float(eigenvalues[-1]), float(eigenvalues[0])
    local = torch.linalg.eigvalsh(clients.precisions)
    return {
        "clients": clients,
        "x_star": mean,
        "post_cov": cov,
        "sigma2": float(cov.trace()),
        "L": big,
        "m": small,
        "gamma0": 2.0 / (big + small),
        "max_local_curvature": float(local.max()),
        # heterogeneity at the optimum: mean over clients of ||grad U^i(x*)||^2 (grad U(x*) = 0)
        "heterogeneity": float(clients.gradients(mean.expand(NUM_CLIENTS, -1)).square().sum(-1).mean()),
    }


def step_size(dim: int, mean_scale: float, comm_prob: float, factor: float) -> float:
    return factor * comm_prob * NUM_CLIENTS * problem(dim, mean_scale)["gamma0"]


def batched_gradients(clients: testing.GaussianClients, chains: int, dtype: torch.dtype):
    """Exact client gradients :math:`A_i (x - \\mu_i)` for ``chains`` chains laid side by side: points
    ``[..., b, chains·d]`` -> gradients of the same shape (chain ``c`` is coordinates ``c·d .. c·d+d-1``).
    Checked (in float64) against :meth:`GaussianClients.gradients`."""
    b, d = clients.num_clients, clients.dim

    def make(dtype):
        transposed = clients.precisions.transpose(-1, -2).to(dtype)
        rows = [transposed[:, None, j, :] for j in range(d)]  # [b, 1, d]: row j of A_i^T
        means = clients.means.to(dtype)[:, None, :]

        def gradients(points: torch.Tensor) -> torch.Tensor:
            diff = points.view(-1, b, chains, d) - means
            out = diff[..., 0:1] * rows[0]
            for j in range(1, d):
                out = out + diff[..., j : j + 1] * rows[j]
            return out.view(points.shape)

        return gradients

    probe = torch.randn(2, b, chains * d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = clients.gradients(probe.view(2, b, chains, d).transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(make(torch.float64)(probe), expected.reshape(probe.shape))
    return make(dtype)


# ------------------------------------------------------------------------------------------- tasks
def simulate(task: dict) -> dict:
    """One group of chains of one algorithm and configuration: per-chain estimates of sigma*^2."""
    torch.set_num_threads(1)
    start_time = time.perf_counter()
    prob = problem(task["dim"], task["mean_scale"])
    clients, d, chains = prob["clients"], task["dim"], task["chains"]
    b, dtype = NUM_CLIENTS, torch.float32
    gradients = batched_gradients(clients, chains, dtype)
    # the pure algorithms carry a leading chain dimension; this script lays its chains side by side in the
    # parameter dimension instead (see the caveat above), so the algorithms see one "chain" of C·d coordinates
    full_gradients = lambda y: gradients(y[:, None, :].expand(-1, b, -1))  # noqa: E731  [1, C·d] -> [1, b, C·d]
    rng, network = Randomness(task["seed"]), InProcessNetwork(b, chains * d)
    step_size = torch.tensor(task["step_size"], dtype=dtype)
    only_chain = torch.zeros(1, dtype=torch.long)
    start = prob["x_star"].to(dtype).repeat(chains)[None]

    def fald_step(state):
        noise = client_noise(rng, (1,), b, chains * d, task["noise_corr"], dtype)
        communicated = bool(rng.coins(task["comm_prob"], 1)[0])
        state = algorithm.step(
            state, gradients, noise, torch.tensor([communicated]), network, step_size=step_size, **extra
        )
        return state, communicated

    if task["algorithm"] == "fald":
        algorithm, extra = fald, {}
        state = fald.init(start, b)

        def step(state):
            state, communicated = fald_step(state)
            return state, communicated, False

    else:
        # full local batches: the stored grad U^i(Y) serves every step
        algorithm, extra = vr_fald, {"exact_gradients": True}
        state = vr_fald.init(start, b, full_gradients, network)

        def step(state):
            refreshed = bool(rng.coins(task["comm_prob"], 1)[0])  # q_c = p_c
            pair = vr_fald.refresh(state, only_chain, full_gradients, network) if refreshed else None
            state, communicated = fald_step(state)  # with the old pair, which is replaced after the step
            return (
                (vr_fald.replace_pair(state, only_chain, pair) if refreshed else state),
                communicated,
                refreshed,
            )

    iterations, burn_in = task["iterations"], task["iterations"] // 10
    kept = iterations - burn_in
    x_star = prob["x_star"].to(dtype).repeat(chains)
    total = torch.zeros(chains, dtype=torch.float64)
    block = min(kept, 4096)
    buffer = torch.empty(block, chains * d, dtype=dtype)
    communications = refreshes = 0
    for _ in range(burn_in):
        state, _, _ = step(state)
    filled = 0
    for _ in range(kept):
        state, communicated, refreshed = step(state)
        communications += communicated
        refreshes += refreshed
        torch.mean(state.clients[0], 0, out=buffer[filled])
        filled += 1
        if filled == block:
            total += (buffer - x_star).double().square().view(block, chains, d).sum((0, 2))
            filled = 0
    if filled:
        total += (buffer[:filled] - x_star).double().square().view(filled, chains, d).sum((0, 2))
    estimates = total / kept
    return {
        **{k: task[k] for k in ("key", "algorithm", "group", "seed")},
        "estimates": estimates.tolist(),
        "finite": bool(torch.isfinite(estimates).all()),
        "communication_rate": communications / kept,
        "refresh_rate": refreshes / kept,
        "seconds": time.perf_counter() - start_time,
    }


def exact(task: dict) -> dict:
    """Exact stationary bias of one algorithm and configuration (float64, no simulation)."""
    torch.set_num_threads(1)
    start_time = time.perf_counter()
    prob = problem(task["dim"], task["mean_scale"])
    args = (prob["clients"], task["step_size"], task["comm_prob"], task["noise_corr"])
    try:
        if task["algorithm"] == "fald":
            law = testing.fald_stationary_law(*args)
        else:
            law = testing.vr_fald_stationary_law(*args, task["comm_prob"])
    except (ValueError, RuntimeError) as error:
        return {"key": task["key"], "algorithm": task["algorithm"], "error": str(error), "bias": None}
    return {
        "key": task["key"],
        "algorithm": task["algorithm"],
        "bias": testing.squared_distance_bias(law, prob["x_star"], prob["post_cov"]),
        "mean_offset_sq": float((law.mean - prob["x_star"]).square().sum()),
        "seconds": time.perf_counter() - start_time,
    }


def run_task(task: dict) -> dict:
    return simulate(task) if task["kind"] == "simulate" else exact(task)


# ------------------------------------------------------------------------------------------- analysis
def summarise(estimates: list[list[float]], sigma2: float) -> dict:
    """MSE = bias² + var over all chains; standard errors from the spread of the G group means."""
    groups = torch.tensor(estimates, dtype=torch.float64)  # [G, C]
    if not torch.isfinite(groups).all():
        return {"finite": False}
    err = groups - sigma2
    sq = err.square()
    g = groups.shape[0]
    mse, bias = float(sq.mean()), float(err.mean())
    var = float(err.var(unbiased=False))

    def se(values: torch.Tensor) -> float:  # standard error of the grand mean from the group means
        return float(values.mean(1).std() / math.sqrt(g)) if g > 1 else float("nan")

    return {
        "finite": True,
        "mse": mse,
        "mse_se": se(sq),
        "bias": bias,
        "bias_se": se(err),
        "bias_sq": bias**2,
        "var": var,
        "chains": groups.numel(),
        "groups": g,
    }


def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}e}"


def configurations(args) -> tuple[list[dict], list[dict]]:
    grid = [
        {"comm_prob": p, "factor": f, "noise_corr": t, "mean_scale": args.mean_scale}
        for t in args.taus
        for f in args.factors
        for p in args.comm_probs
    ]
    sweep = [
        {"comm_prob": args.sweep[0], "factor": args.sweep[1], "noise_corr": args.sweep[2], "mean_scale": s}
        for s in args.mean_scales
    ]
    configs = []
    for c in grid + sweep:
        c = {
            **c,
            "dim": args.dim,
            "key": f"p{c['comm_prob']}_f{c['factor']}_t{c['noise_corr']}_s{c['mean_scale']}",
        }
        c["step_size"] = step_size(args.dim, c["mean_scale"], c["comm_prob"], c["factor"])
        if c["key"] not in {x["key"] for x in configs}:
            configs.append(c)
    keys = {"grid": [], "sweep": []}
    for part, cs in (("grid", grid), ("sweep", sweep)):
        for c in cs:
            keys[part].append(f"p{c['comm_prob']}_f{c['factor']}_t{c['noise_corr']}_s{c['mean_scale']}")
    return configs, keys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny grid, few iterations")
    parser.add_argument("--dim", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=None, help="k1 per chain (default 15000)")
    parser.add_argument("--groups", type=int, default=None, help="seeds per configuration (default 4)")
    parser.add_argument("--chains", type=int, default=None, help="chains per group (default 25)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-exact", action="store_true", help="skip the exact stationary biases")
    parser.add_argument("--seed", type=int, default=2023)
    parser.add_argument("--comm-probs", type=float, nargs="+", help="p_c grid (default 0.1 0.5 1)")
    parser.add_argument("--factors", type=float, nargs="+", help="step factors (default 0.02 0.1)")
    args = parser.parse_args(argv)
    args.comm_probs_cli, args.factors_cli = args.comm_probs, args.factors
    args.mean_scale = 10.0
    if args.quick:
        args.comm_probs, args.factors, args.taus = [0.1, 1.0], [0.1], [0.0, 1.0]
        args.mean_scales = [0.0, 10.0]
        defaults = (2000, 2, 5)
    else:
        args.comm_probs, args.factors, args.taus = [0.1, 0.5, 1.0], [0.02, 0.1], [0.0, 1.0]
        args.mean_scales = [0.0, 1.0, 3.0, 10.0]
        defaults = (15000, 4, 25)
    args.comm_probs = args.comm_probs_cli or args.comm_probs
    args.factors = args.factors_cli or args.factors
    args.sweep = (0.1, 0.1, 1.0)  # (p_c, factor, tau) of the heterogeneity sweep
    args.iterations = args.iterations or defaults[0]
    args.groups = args.groups or defaults[1]
    args.chains = args.chains or defaults[2]

    wall = time.perf_counter()
    configs, keys = configurations(args)
    tasks = []
    for c in configs:
        for algorithm in ALGORITHMS:
            if not args.no_exact:
                tasks.append({**c, "kind": "exact", "algorithm": algorithm})
            for group in range(args.groups):
                tasks.append(
                    {
                        **c,
                        "kind": "simulate",
                        "algorithm": algorithm,
                        "group": group,
                        "seed": args.seed + 7919 * group,  # same seed for both algorithms (common noise)
                        "chains": args.chains,
                        "iterations": args.iterations,
                    }
                )
    tasks.sort(key=lambda t: t["kind"] == "exact")  # simulations first: they are the long ones
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            outputs = list(pool.map(run_task, tasks))
    else:
        outputs = [run_task(t) for t in tasks]
    wall = time.perf_counter() - wall

    # ---------------------------------------------------------------- gather
    rows = {}
    for c in configs:
        prob = problem(args.dim, c["mean_scale"])
        row = {k: c[k] for k in ("key", "comm_prob", "factor", "noise_corr", "mean_scale", "step_size")}
        row["sigma2"] = prob["sigma2"]
        for algorithm in ALGORITHMS:
            sims = sorted(
                (
                    o
                    for o in outputs
                    if o["key"] == c["key"] and o["algorithm"] == algorithm and "estimates" in o
                ),
                key=lambda o: o["group"],
            )
            stats = summarise([o["estimates"] for o in sims], prob["sigma2"])
            stats["communication_rate"] = sum(o["communication_rate"] for o in sims) / len(sims)
            stats["seconds"] = sum(o["seconds"] for o in sims)
            ex = next(
                (o for o in outputs if o["key"] == c["key"] and o["algorithm"] == algorithm and "bias" in o),
                None,
            )
            stats["exact"] = ex
            stats["exact_bias"] = ex["bias"] if ex else None
            if stats["finite"] and stats["exact_bias"] is not None and stats["bias_se"] > 0:
                stats["z"] = (stats["bias"] - stats["exact_bias"]) / stats["bias_se"]
            row[algorithm] = stats
        row["unstable"] = [
            a for a in ALGORITHMS if "mean-square stable" in (row[a]["exact"] or {}).get("error", "")
        ]
        f, v = row["fald"], row["vr_fald"]
        row["ratio"] = f["mse"] / v["mse"] if f["finite"] and v["finite"] and v["mse"] > 0 else None
        ef, ev = f["exact_bias"], v["exact_bias"]
        row["ratio_exact"] = (ef / ev) ** 2 if ef is not None and ev not in (None, 0.0) else None
        rows[c["key"]] = row

    # ---------------------------------------------------------------- tables
    base = problem(args.dim, args.mean_scale)
    header = (
        f"b = {NUM_CLIENTS} clients, d = {args.dim}, mean_scale = {args.mean_scale:g} (client seed "
        f"{CLIENT_SEED}); σ⋆² = {base['sigma2']:.5f}, L = {base['L']:.2f}, m = {base['m']:.2f}, "
        f"γ0 = 2/(L+m) = {base['gamma0']:.5f}, largest client curvature {base['max_local_curvature']:.1f}.\n"
        f"Per configuration and algorithm: {args.groups * args.chains} chains ({args.groups} seeds × "
        f"{args.chains} chains sharing coins) of k1 = {args.iterations} iterations, burn-in k0 = "
        f"{args.iterations // 10}; full local batches, exact gradients, float32 dynamics. "
        f"(The paper: 100 chains × 10^7 iterations.)\n"
        f"MSE = bias² + var of σ̂² = mean_k ||X̄_k − x⋆||²; ± = standard error from the spread of the "
        f"{args.groups} seed-group means; exact = exact stationary bias E||X̄ − x⋆||² − σ⋆² of the chain; "
        f"z = (measured bias − exact bias) / its standard error; ratio = MSE FALD / MSE VR-FALD⋆; ratio ∞ = "
        f"(exact bias FALD / exact bias VR-FALD⋆)², the limit of the ratio as k1 → ∞ (variance → 0)."
    )

    def exact_cell(r: dict, a: str) -> str:
        if r[a]["exact_bias"] is not None:
            return fmt(r[a]["exact_bias"])
        return "unstable" if a in r["unstable"] else "—"

    def table(keys_: list[str], first: str) -> list[str]:
        cols = [first, "γ", "τ"]
        for a in ALGORITHMS:
            cols += [f"MSE {LABEL[a]}", f"bias² {LABEL[a]}", f"var {LABEL[a]}", f"exact bias {LABEL[a]}", "z"]
        cols += ["ratio", "ratio ∞"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for k in keys_:
            r = rows[k]
            lead = f"{r['comm_prob']:g}" if first == "p_c (factor)" else f"{r['mean_scale']:g}"
            if first == "p_c (factor)":
                lead += f" ({r['factor']:g})"
            cells = [lead, f"{r['step_size']:.4f}", f"{r['noise_corr']:g}"]
            for a in ALGORITHMS:
                s = r[a]
                if not s["finite"]:
                    cells += ["diverged", "—", "—", exact_cell(r, a), "—"]
                    continue
                cells += [
                    f"{s['mse']:.2e} ± {s['mse_se']:.1e}",
                    fmt(s["bias_sq"]),
                    fmt(s["var"]),
                    exact_cell(r, a),
                    f"{s['z']:+.1f}" if "z" in s else "—",
                ]
            cells.append(f"{r['ratio']:.3g}" if r["ratio"] is not None else "—")
            cells.append(f"{r['ratio_exact']:.3g}" if r["ratio_exact"] is not None else "—")
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    grid_lines = table(keys["grid"], "p_c (factor)")
    sweep_cfg = args.sweep
    sweep_lines = table(keys["sweep"], "mean_scale")

    # ---------------------------------------------------------------- verdicts
    verdicts = []
    unstable = [k for k in keys["grid"] + keys["sweep"] if rows[k]["unstable"]]
    if unstable:
        verdicts.append(
            f"Excluded from the verdicts: {', '.join(unstable)} -- not mean-square stable (exact solver), "
            "the chains' second moments diverge; their numbers measure nothing."
        )
    grid_rows = [rows[k] for k in keys["grid"] if k not in unstable]
    below_one = [r for r in grid_rows if r["comm_prob"] < 1]
    at_one = [r for r in grid_rows if r["comm_prob"] >= 1]

    def wins(r):
        f, v = r["fald"], r["vr_fald"]
        return f["finite"] and v["finite"] and v["mse"] < f["mse"]

    def clear_win(r):  # the difference of the MSEs exceeds 3 standard errors (conservative: SEs added)
        f, v = r["fald"], r["vr_fald"]
        return wins(r) and f["mse"] - v["mse"] > 3 * (f["mse_se"] + v["mse_se"])

    n_win = sum(wins(r) for r in below_one)
    n_clear = sum(clear_win(r) for r in below_one)
    ratios = [r["ratio"] for r in below_one if r["ratio"]]
    text = (
        f"(1) VR-FALD⋆ lower MSE than FALD: at p_c < 1 in {n_win}/{len(below_one)} configurations "
        f"({n_clear} by more than 3 standard errors), MSE ratio FALD/VR-FALD⋆ from "
        f"{min(ratios):.3g} to {max(ratios):.3g}."
        if ratios
        else "(1) no finite p_c < 1 configuration."
    )
    if at_one:
        same = [r["ratio"] for r in at_one if r["ratio"]]
        text += (
            f" At p_c = 1 ({len(at_one)} configurations) the two algorithms are the same chain with full "
            f"batches; measured ratios {', '.join(f'{x:.4f}' for x in same)}: a tie, so 'lower for every "
            f"(p_c, γ)' holds only for p_c < 1."
        )
    ex_better = [
        r
        for r in below_one
        if r["fald"]["exact_bias"] is not None
        and r["vr_fald"]["exact_bias"] is not None
        and abs(r["vr_fald"]["exact_bias"]) < abs(r["fald"]["exact_bias"])
    ]
    with_exact = [
        r for r in below_one if r["fald"]["exact_bias"] is not None and r["vr_fald"]["exact_bias"] is not None
    ]
    if with_exact:
        text += (
            f" Exact stationary |bias| smaller for VR-FALD⋆ in {len(ex_better)}/{len(with_exact)} (p_c < 1)."
        )
    verdicts.append(text)

    sweep_rows = [rows[k] for k in keys["sweep"] if k not in unstable]
    gaps = [r["fald"]["mse"] - r["vr_fald"]["mse"] if r["ratio"] is not None else None for r in sweep_rows]
    sratios = [r["ratio"] for r in sweep_rows]
    if all(g is not None for g in gaps):
        inc_gap = all(b_ > a_ for a_, b_ in zip(gaps, gaps[1:], strict=False))
        inc_ratio = all(b_ > a_ for a_, b_ in zip(sratios, sratios[1:], strict=False))
        ex_gap = [
            (r["fald"]["exact_bias"] or 0) ** 2 - (r["vr_fald"]["exact_bias"] or 0) ** 2 for r in sweep_rows
        ]
        inc_ex = all(b_ > a_ for a_, b_ in zip(ex_gap, ex_gap[1:], strict=False))

        def trend(flag: bool) -> str:
            return "increasing" if flag else "NOT monotonically increasing"

        scales = ", ".join(format(r["mean_scale"], "g") for r in sweep_rows)
        verdicts.append(
            f"(2) gap vs heterogeneity (p_c = {sweep_cfg[0]:g}, factor {sweep_cfg[1]:g}, "
            f"τ = {sweep_cfg[2]:g}; mean_scale {scales}): MSE gap FALD − VR-FALD⋆ = "
            f"{', '.join(f'{g:.2e}' for g in gaps)} ({trend(inc_gap)}); "
            f"MSE ratio {', '.join(f'{x:.3g}' for x in sratios)} ({trend(inc_ratio)}); "
            f"exact bias² gap {', '.join(f'{g:.2e}' for g in ex_gap)} ({trend(inc_ex)})."
        )
    else:
        verdicts.append("(2) some sweep configuration diverged; see the table.")

    pairs = []
    for r0 in grid_rows:
        if r0["noise_corr"] != 0.0:
            continue
        r1 = next(
            (
                r
                for r in grid_rows
                if r["noise_corr"] == 1.0
                and r["comm_prob"] == r0["comm_prob"]
                and r["factor"] == r0["factor"]
            ),
            None,
        )
        if r1 is not None:
            pairs.append((r0, r1))
    ex_pairs = [
        (a, b_)
        for a, b_ in pairs
        if a["vr_fald"]["exact_bias"] is not None and b_["vr_fald"]["exact_bias"] is not None
    ]
    lines3 = []
    n_ex = n_tie = n_meas = n_sig = 0
    for a, b_ in pairs:
        e0, e1 = a["vr_fald"]["exact_bias"], b_["vr_fald"]["exact_bias"]
        m0, m1 = a["vr_fald"].get("bias"), b_["vr_fald"].get("bias")
        s0, s1 = a["vr_fald"].get("bias_se", float("nan")), b_["vr_fald"].get("bias_se", float("nan"))
        if e0 is not None and e1 is not None:
            n_ex += abs(e1) < abs(e0) * (1 - 1e-9)
            n_tie += abs(abs(e1) - abs(e0)) <= 1e-9 * abs(e0)
        if m0 is not None and m1 is not None:
            n_meas += abs(m1) < abs(m0)
            n_sig += abs(m0) - abs(m1) > 2 * math.hypot(s0, s1)
        lines3.append(
            f"p_c={a['comm_prob']:g}, factor {a['factor']:g}: exact {fmt(e0)} (τ=0) vs {fmt(e1)} (τ=1); "
            f"measured {fmt(m0)} ± {fmt(s0, 1)} vs {fmt(m1)} ± {fmt(s1, 1)}"
        )
    verdicts.append(
        "(3) VR-FALD⋆ |bias| smaller at τ = 1 than at τ = 0: exact stationary bias smaller in "
        f"{n_ex}/{len(ex_pairs)} (p_c, γ) pairs, equal (to 1e-9) in {n_tie}, larger in "
        f"{len(ex_pairs) - n_ex - n_tie}; the measured bias is smaller in {n_meas}/{len(pairs)}, "
        f"{n_sig} by more than 2 standard errors (at this budget the Monte Carlo error is of the size of the "
        "difference). "
        + "; ".join(lines3)
        + (". " if lines3 else "")
        + "(At p_c = 1 τ has no effect: the average always gets noise variance 2γ/b, see "
        "pyro_fed.algorithms.langevin.client_noise.)"
    )

    # ---------------------------------------------------------------- output
    suffix = "_quick" if args.quick else ""
    md = [
        "# FALD vs VR-FALD⋆ on heterogeneous Gaussian clients (FALD paper, Table 1)",
        "",
        "Generated by `python benchmarks/gaussian_heterogeneity.py"
        + (" --quick" if args.quick else "")
        + "`.",
        "",
        header,
        "",
        "## Grid over (p_c, γ = factor·p_c·b·γ0, τ), q_c = p_c, mean_scale = 10",
        "",
        *grid_lines,
        "",
        f"## Heterogeneity sweep (p_c = {sweep_cfg[0]:g}, factor {sweep_cfg[1]:g}, τ = {sweep_cfg[2]:g})",
        "",
        "Heterogeneity at the optimum, mean_i ||∇U^i(x⋆)||²: "
        + ", ".join(f"{problem(args.dim, s)['heterogeneity']:.3g} (scale {s:g})" for s in args.mean_scales)
        + ".",
        "",
        *sweep_lines,
        "",
        "## Verdicts on the paper's claims",
        "",
        *[f"- {v}" for v in verdicts],
        "",
        f"Wall time {wall:.0f} s with {args.workers} worker process(es) on {os.cpu_count()} CPUs.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gaussian_heterogeneity{suffix}.md").write_text("\n".join(md) + "\n")
    payload = {
        "settings": {
            "num_clients": NUM_CLIENTS,
            "dim": args.dim,
            "client_seed": CLIENT_SEED,
            "iterations": args.iterations,
            "burn_in": args.iterations // 10,
            "groups": args.groups,
            "chains_per_group": args.chains,
            "seed": args.seed,
            "comm_probs": args.comm_probs,
            "factors": args.factors,
            "taus": args.taus,
            "sweep": {"comm_prob": sweep_cfg[0], "factor": sweep_cfg[1], "noise_corr": sweep_cfg[2]},
            "mean_scales": args.mean_scales,
            "dtype_dynamics": "float32",
        },
        "problem": {
            str(s): {k: v for k, v in problem(args.dim, s).items() if isinstance(v, float)}
            for s in args.mean_scales
        },
        "grid": keys["grid"],
        "sweep": keys["sweep"],
        "rows": rows,
        "raw": outputs,
        "verdicts": verdicts,
        "wall_seconds": wall,
        "workers": args.workers,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
    }
    (RESULTS / f"gaussian_heterogeneity{suffix}.json").write_text(json.dumps(payload, indent=1))
    plot(rows, keys, args, RESULTS / f"gaussian_heterogeneity{suffix}.png")
    print("\n".join(md))


def plot(rows: dict, keys: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.taus) + 1, figsize=(5 * (len(args.taus) + 1), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, tau in zip(axes, args.taus, strict=False):
        for i, factor in enumerate(args.factors):
            sel = [
                rows[k] for k in keys["grid"] if rows[k]["noise_corr"] == tau and rows[k]["factor"] == factor
            ]
            for a, style in (("fald", "-o"), ("vr_fald", "--s")):
                pts = [(r["comm_prob"], r[a]["mse"], r[a]["mse_se"]) for r in sel if r[a]["finite"]]
                if pts:
                    x, y, err = zip(*pts, strict=False)
                    ax.errorbar(
                        x,
                        y,
                        yerr=err,
                        capsize=2,
                        fmt=style,
                        color=colors[i],
                        label=f"{LABEL[a]}, factor {factor:g}",
                    )
        ax.set(xscale="log", yscale="log", xlabel="p_c", ylabel="MSE of σ̂²", title=f"τ = {tau:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    sel = [rows[k] for k in keys["sweep"]]
    for a, style in (("fald", "-o"), ("vr_fald", "--s")):
        pts = [(r["mean_scale"], r[a]["mse"], r[a]["mse_se"]) for r in sel if r[a]["finite"]]
        if pts:
            x, y, err = zip(*pts, strict=False)
            ax.errorbar(x, y, yerr=err, capsize=2, fmt=style, label=LABEL[a])
    ax.set(
        xscale="symlog",
        yscale="log",
        xlabel="mean_scale (heterogeneity)",
        ylabel="MSE of σ̂²",
        title=f"sweep: p_c={args.sweep[0]:g}, factor {args.sweep[1]:g}, τ={args.sweep[2]:g}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
