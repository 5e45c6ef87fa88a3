"""Cost of one FALD iteration: the pyro_fed kernel (three gradient modes) against a hand-written torch step.

What is measured
----------------
Wall-clock time of **one FALD iteration** (the FALD paper's Section 2: fresh minibatch gradient of every
client, correlated Langevin noise, one communication coin, averaging when it lands heads, the reported client
average) for Bayesian logistic regression with ``d = 10`` features, a ``Normal(0, 1)`` prior on the
weights, synthetic data, an i.i.d. partition with 64 points per client (``N = 64 b``) and minibatches of 32
points per client, at ``b = 10, 100, 1000`` clients (``--clients 1 10 100 1000`` adds ``b = 1``), for:

(k) **kernel** -- the library: ``pyro_fed.FaldKernel(model, clients, step_size, comm_prob=0.5,
    batch_size=32, gradient_mode=...)`` driven by hand as :class:`pyro.infer.MCMC` drives it: after
    ``kernel.setup(warmup_steps=0, x, y)``, calls of ``kernel.sample(params)``. The kernel runs a *chunk*
    of ``chunk_size = 64`` iterations at a time (randomness drawn ahead, each iteration one prepared
    function) and serves one draw per call from its buffers, so one call in 64 runs a chunk and the others
    only read a buffer. Every timed block therefore starts at a chunk boundary and spans whole chunks
    (``number`` is a multiple of the chunk length): the per-call time is the chunk's cost amortised
    honestly, plus the per-draw serving. This includes all the kernel's bookkeeping (minibatch sampler,
    noise, coins, finite-check and revert, dispersion, per-draw statistics, bit accounting, the returned
    ``params`` dict). Three gradient modes: ``"compiled"`` (each iteration traced with ``make_fx`` and
    compiled by TorchInductor: what the **default** ``"auto"`` runs once a run is long enough to pay for the
    compilation, which for a kernel driven by hand is after its first chunk), ``"traced"`` (traced only)
    and ``"eager"`` (the vmapped Pyro model at every iteration). The one-off cost of ``setup`` plus the
    first call (which draws the first chunk's randomness, traces and compiles the iteration, and runs the
    chunk) is recorded per mode.
(b) **hand-written** -- the fastest reasonable plain-torch code for this model: the clients' data stored
    client-major, minibatches without replacement by walking a per-client permutation redrawn once per
    local epoch (one ``argsort`` of ``[b, 64]`` random keys every 2 iterations, then one ``index_select``
    of the permuted epoch and views), the logistic gradient written by hand as batched ops over
    ``[b, n, d]`` (``bmm``, ``sigmoid``, ``baddbmm``), noise, a host coin and averaging. No Pyro, no
    bookkeeping, no compilation.
(n) **written for NUTS** -- the default kernel on the same model written as a NUTS user writes it (the
    logits at full size, ``obs=y``), which pyro_fed runs on each client's rows of the data arguments: the
    iteration should cost what it costs on the model read through the plate's indices.
(c) **chains** -- ``C = 8`` chains of the default kernel at ``b = 100`` (one batched state ``[8, 100, d]``;
    the kernel is told the plan as ``MCMC(kernel, num_chains=8)`` would tell it, by setting
    ``kernel.plan = ChainPlan(8, None, None)`` before ``setup``), against **one** chain at ``b = 800``
    clients (the same ``800 x 64`` client-data rows per iteration) and the hand-written step at
    ``b = 800``. Driven by hand, the kernel serves chain 0's draws, and each ``sample`` call advances all 8
    chains by one iteration, so the per-call time is the cost of one iteration of the 8-chain state.

A gradient cross-check on one set of minibatches confirms that the kernel's batched gradient (vmapped
Pyro model), a Pyro trace of the model evaluated client by client and the hand-written gradient agree
before anything is timed. (The former Python-loop-over-clients implementation is no longer timed: it was
20-130x slower than the kernel; it remains the reference of the gradient check.)

Why
---
The project's performance goal is that an iteration cost little more than its tensor work. With
the chunked engine the targets are: the default kernel within **1.5x** of the hand-written step at
``b = 100`` and ``b = 1000``, within **2x** at ``b = 10`` (where fixed per-iteration costs dominate), and
8 chains at ``b = 100`` costing no more per iteration than one chain at ``b = 800``. The script reports
whether each target is met; it never fails on them. ``--profile`` (and, always, a short profile of the
default kernel at the largest ``b``) says where the kernel's time goes: the minibatch sampler, the
iterations (engine), the noise, the per-chunk record, the per-draw serving.

How
---
Single-threaded (``torch.set_num_threads(1)``), float32, CPU. Each measurement follows ``timeit``:
warm-up calls (for a kernel: up to the end of its first chunk plus one more chunk), then ``repeats`` timed
blocks of ``number`` consecutive calls each (``number`` chosen so that a block lasts at least
``--min-block`` seconds, and a whole number of chunks for a kernel), reporting the median over blocks of the
per-call time. The blocks of the implementations are interleaved, so that a change in machine load (other
processes) hits all of them alike; absolute times still move with the load, the ratios much less. The
traced and eager kernels get at most ``--slow-budget`` seconds per ``b`` (at least 3 blocks of one chunk).
The garbage collector stays enabled (as in a real MCMC run). TorchInductor caches compiled code on disk,
so the recorded compilation time is much longer on a machine's first run than on later runs.

Run from the repository root::

    python benchmarks/step_cost.py            # full run, b = 10, 100, 1000 + chains (a few minutes)
    python benchmarks/step_cost.py --quick    # smoke run: b = 10, 100, chains at b = 10 vs 80, fewer repeats
    python benchmarks/step_cost.py --profile 1000  # also write a cProfile of kernel.sample at b = 1000

Results: ``benchmarks/results/step_cost.md`` and ``step_cost.json`` (``step_cost_quick.*`` with
``--quick``; ``step_cost_profile_b{B}.txt`` with ``--profile B``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import platform
import pstats
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

import pyro_fed
from pyro_fed.data import partition
from pyro_fed.kernels.base import ChainPlan

DIM = 10
POINTS_PER_CLIENT = 64
BATCH_SIZE = 32
STEP_SIZE = 1e-2  # stable: local Lipschitz constant ~ 64/4 per client, 16 * 0.01 << 2
COMM_PROB = 0.5
NOISE_CORR = 1.0  # the kernel's default tau
MODES = ("compiled", "traced", "eager")  # the first is the steady state of the kernels' default, "auto"
DEFAULT_MODE = MODES[0]
#: default kernel / hand-written, at most, per b (b not listed: no target)
TARGETS = {10: 2.0, 100: 1.5, 1000: 1.5}
NUM_CHAINS = 8
RESULTS = Path(__file__).resolve().parent / "results"


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    """Bayesian logistic regression; the likelihood is a full-size plate read through its indices."""
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[-1], dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


def model_for_nuts(x: torch.Tensor, y: torch.Tensor) -> None:
    """:func:`model` as a NUTS user writes it: the logits at full size, ``obs=y`` (pyro_fed runs it on each
    client's rows of ``x`` and ``y``)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[-1], dtype=x.dtype), 1.0).to_event(1))
    logits = x @ w
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)


class Problem:
    """Synthetic data split i.i.d. into ``b`` clients of 64 points."""

    def __init__(self, num_clients: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.b = num_clients
        self.num_data = POINTS_PER_CLIENT * num_clients
        self.x = torch.randn(self.num_data, DIM, generator=gen)
        w_true = torch.randn(DIM, generator=gen)
        self.y = torch.bernoulli(torch.sigmoid(self.x @ w_true), generator=gen)
        self.clients = partition.iid(self.num_data, num_clients, seed=seed)
        self.client_indices = [torch.nonzero(self.clients == i).squeeze(1) for i in range(num_clients)]
        self.sizes = torch.tensor([len(ix) for ix in self.client_indices])
        if not bool((self.sizes == POINTS_PER_CLIENT).all()):
            raise RuntimeError("the i.i.d. split should give every client exactly 64 points")
        self.table = torch.stack(self.client_indices)  # [b, 64] global data indices per client
        self.prior_weights = self.sizes.float() / self.num_data  # "proportional", as the kernel
        self.initial = torch.zeros(num_clients, DIM)  # the prior median, where the kernel starts


# ------------------------------------------------------------------ (k) the library kernel
def make_kernel_step(
    problem: Problem, seed: int, num_chains: int = 1, of=model, **options
) -> Callable[[], object]:
    """``kernel.sample`` as MCMC calls it, for the model ``of``; ``step.first_call_s`` is the one-off cost
    of ``setup`` and the first call (the first chunk: drawing its randomness, tracing and compiling the
    iteration, running it); ``step.chunk`` the iterations per chunk (timed blocks span whole chunks)."""
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    kernel = pyro_fed.FaldKernel(
        of, problem.clients, step_size=STEP_SIZE, comm_prob=COMM_PROB, batch_size=BATCH_SIZE, **options
    )
    if num_chains > 1:  # what MCMC(kernel, num_chains=C) tells the kernel; driven by hand: no draw count
        kernel.plan = ChainPlan(num_chains, None, None)
    kernel.setup(0, problem.x, problem.y)
    params = kernel.sample(kernel.initial_params)
    first_call_s = time.perf_counter() - start

    def step():
        nonlocal params
        params = kernel.sample(params)
        return params["w"]

    step.kernel = kernel
    step.first_call_s = first_call_s
    step.calls = 1  # calls made so far (to start timed blocks at a chunk boundary)
    step.chunk = kernel.runner.chunk // kernel.current_thinning  # draws per chunk
    return step


# ------------------------------------------------------------------ (b) hand-written batched torch
class FaldUpdate:
    """Noise, coin and averaging of FALD given the clients' gradients (pyro_fed.algorithms.fald)."""

    def __init__(self, b: int, seed: int):
        self.b = b
        self.gen = torch.Generator().manual_seed(seed)
        self.coins = random.Random(seed + 1)
        # sqrt(2 gamma) Z^i with Z^i = sqrt(tau/b) Z~ + sqrt(1-tau) Z~^i, drawing only what tau needs
        self.shared_scale = math.sqrt(2.0 * STEP_SIZE * NOISE_CORR / b)
        self.private_scale = math.sqrt(2.0 * STEP_SIZE * (1.0 - NOISE_CORR))

    def __call__(self, clients: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, d = clients.shape
        proposed = torch.add(clients, grads, alpha=-STEP_SIZE)
        if self.private_scale > 0:
            proposed.add_(torch.randn(b, d, generator=self.gen), alpha=self.private_scale)
        if self.shared_scale > 0:
            proposed.add_(torch.randn(1, d, generator=self.gen), alpha=self.shared_scale)
        if self.coins.random() < COMM_PROB:  # one coin for all clients, drawn on the host
            proposed = proposed.mean(0, keepdim=True).expand(b, d)
        return proposed, proposed.mean(0)  # new client iterates, reported draw


def hand_grads(
    clients: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, prior_weights: torch.Tensor, lik_scale: float
) -> torch.Tensor:
    """``varpi^i w_i + (N_i/n) sum_j (sigmoid(x_ij . w_i) - y_ij) x_ij`` for clients ``[b, d]``, minibatch
    features ``xb`` ``[b, n, d]`` and labels ``yb`` ``[b, n]``."""
    neg_residual = torch.sigmoid(torch.bmm(xb, clients.unsqueeze(-1)).squeeze(-1)).sub_(yb)  # [b, n]
    prior = (prior_weights[:, None] * clients).unsqueeze(1)  # [b, 1, d]
    return torch.baddbmm(prior, neg_residual.unsqueeze(1), xb, alpha=lik_scale).squeeze(1)


def make_hand_step(problem: Problem, seed: int) -> Callable[[], torch.Tensor]:
    b, n_local = problem.table.shape
    update = FaldUpdate(b, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    x_flat = problem.x[problem.table].reshape(b * n_local, DIM)  # client-major local data
    y_flat = problem.y[problem.table].reshape(b * n_local)
    row_offsets = (torch.arange(b) * n_local)[:, None]
    prior_weights = problem.prior_weights
    lik_scale = float(n_local) / BATCH_SIZE
    clients = problem.initial.clone()
    x_epoch = y_epoch = None
    offset = n_local  # reshuffle on the first call

    def step():
        nonlocal clients, x_epoch, y_epoch, offset
        if offset + BATCH_SIZE > n_local:
            # new local epoch (every 2 iterations): each client permutes its own data once, as a DataLoader
            flat = (torch.rand(b, n_local, generator=gen).argsort(1) + row_offsets).reshape(-1)
            x_epoch = x_flat.index_select(0, flat).view(b, n_local, DIM)
            y_epoch = y_flat.index_select(0, flat).view(b, n_local)
            offset = 0
        xb = x_epoch[:, offset : offset + BATCH_SIZE]  # views, no copy
        yb = y_epoch[:, offset : offset + BATCH_SIZE]
        offset += BATCH_SIZE
        clients, draw = update(clients, hand_grads(clients, xb, yb, prior_weights, lik_scale))
        return draw

    step.first_call_s = 0.0
    step.calls = 0
    step.chunk = 1
    return step


# ------------------------------------------------------------------ gradient check
def pyro_client_grad(problem: Problem, w: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Minibatch gradient of one client's potential, from a Pyro trace of the model: the plate scales the
    minibatch by ``N / n`` and the outer scale ``N_i / N`` turns that into ``N_i / n`` for the likelihood
    and ``N_i / N`` (the proportional prior weight) for the prior."""
    w = w.detach().requires_grad_(True)
    conditioned = poutine.condition(model, data={"w": w, "data": indices})
    trace = poutine.trace(poutine.scale(conditioned, scale=scale)).get_trace(problem.x, problem.y)
    (grad,) = torch.autograd.grad(-trace.log_prob_sum(), w)
    return grad


def gradient_check(b: int = 10, seed: int = 1) -> dict[str, float]:
    """Max abs difference of the kernel's (vmapped Pyro), a client-by-client Pyro trace's and the
    hand-written client gradients on the same points and minibatches."""
    problem = Problem(b, seed)
    gen = torch.Generator().manual_seed(seed)
    points = torch.randn(b, DIM, generator=gen)
    cols = torch.rand(b, POINTS_PER_CLIENT, generator=gen).argsort(1)[:, :BATCH_SIZE]
    global_idx = problem.table.gather(1, cols)
    kernel = make_kernel_step(problem, seed, gradient_mode="traced").kernel
    pot = kernel.potential
    k_grads = pot.client_grads(points, pot.batches(list(global_idx)))
    with pyro.validation_enabled(False):
        loop_grads = torch.stack(
            [
                pyro_client_grad(
                    problem, points[i], global_idx[i], float(problem.sizes[i]) / problem.num_data
                )
                for i in range(b)
            ]
        )
    h_grads = hand_grads(
        points,
        problem.x[global_idx],
        problem.y[global_idx],
        problem.prior_weights,
        POINTS_PER_CLIENT / BATCH_SIZE,
    )
    return {
        "max_abs_grad": float(k_grads.abs().max()),
        "kernel_vs_pyro_trace": float((k_grads - loop_grads).abs().max()),
        "kernel_vs_hand": float((k_grads - h_grads).abs().max()),
    }


# ------------------------------------------------------------------ timing
def advance(step: Callable, calls: int) -> None:
    for _ in range(calls):
        step()
    step.calls += calls


def to_boundary(step: Callable) -> None:
    """Call ``step`` until the next call starts a chunk."""
    advance(step, -step.calls % step.chunk)


def measure(
    steps: dict[str, Callable[[], object]],
    *,
    repeats: int,
    min_block: float,
    warmup_chunks: int,
    budgets: dict[str, float] | None = None,
) -> dict[str, dict]:
    """``timeit``-style: for each implementation, ``repeats`` blocks of ``number`` calls (``number`` a whole
    number of chunks such that a block lasts ``min_block`` seconds; fewer blocks when ``budgets[name]``
    seconds would be exceeded, but at least 3 blocks of one chunk); the median per-call seconds over
    blocks. Every block of a kernel starts at a chunk boundary.

    The blocks of the implementations are interleaved (kernel block, hand-written block, ..., kernel
    block, ...) so that a change in machine load affects all of them alike and the ratios stay meaningful.
    """
    budgets = budgets or {}
    plan = {}
    for name, step in steps.items():
        to_boundary(step)
        advance(step, warmup_chunks * step.chunk)
        calibration = max(step.chunk, 8)  # whole chunks (a chunk of 1 for the hand-written step)
        calibration += -calibration % step.chunk
        start = time.perf_counter()
        out = None
        for _ in range(calibration):
            out = step()
        step.calls += calibration
        if isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"{name}: non-finite draw, the step size is unstable for this problem")
        single = max((time.perf_counter() - start) / calibration, 1e-7)
        chunks_per_block = max(1, math.ceil(min_block / (single * step.chunk)))
        reps = repeats
        budget = budgets.get(name)
        if budget is not None and reps * chunks_per_block * step.chunk * single > budget:
            chunks_per_block = max(1, math.floor(budget / (reps * step.chunk * single)))
            reps = max(3, min(reps, math.floor(budget / (chunks_per_block * step.chunk * single))))
        plan[name] = (chunks_per_block * step.chunk, reps)
    per_call: dict[str, list[float]] = {name: [] for name in steps}
    for block in range(max(reps for _, reps in plan.values())):
        for name, step in steps.items():
            number, reps = plan[name]
            if block >= reps:
                continue
            to_boundary(step)  # a no-op: blocks are whole chunks
            start = time.perf_counter()
            for _ in range(number):
                step()
            per_call[name].append((time.perf_counter() - start) / number)
            step.calls += number
    return {
        name: {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "repeats": len(times),
            "number": plan[name][0],
            "chunk": steps[name].chunk,
            "per_call_s": times,
        }
        for name, times in per_call.items()
    }


#: (file, function) of the kernel's parts, as cProfile names them, for the breakdown
PARTS = {
    "minibatch sampler": ("minibatch.py", "__call__"),
    "iterations (engine.run)": ("engine.py", "run"),
    "noise": ("langevin.py", "client_noise"),
    "coins": ("fald.py", "coins"),
    "bits (per chunk)": ("base.py", "record"),
    "serve a draw (unconstrained_params)": ("potential.py", "unconstrained_params"),
}


def profile_kernel(b: int, chunks: int, seed: int, top: int = 25) -> tuple[dict, str]:
    """cProfile of ``chunks`` whole chunks of ``kernel.sample`` calls of the default kernel at ``b``
    clients (after warm-up): the per-iteration seconds of each part of :data:`PARTS` and the report."""
    step = make_kernel_step(Problem(b, seed), seed)
    to_boundary(step)
    advance(step, 2 * step.chunk)
    calls = chunks * step.chunk
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    advance(step, calls)
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    cumulative = {}
    for (filename, _, function), (_, _, _, cum, _) in stats.stats.items():
        for part, (file, name) in PARTS.items():
            # the outermost of a part's functions of one name (a sampler calling its blocks' samplers)
            if filename.endswith(file) and function == name:
                cumulative[part] = max(cumulative.get(part, 0.0), cum)
    profiled = stats.total_tt
    breakdown = {
        "b": b,
        "iterations": calls,
        "wall_per_iteration_s": wall / calls,
        "profiled_per_iteration_s": profiled / calls,
        "parts_per_iteration_s": {part: cumulative[part] / calls for part in PARTS if part in cumulative},
    }
    breakdown["parts_per_iteration_s"]["other"] = (profiled - sum(cumulative.values())) / calls
    text = io.StringIO()
    text.write(
        f"cProfile of {calls} x kernel.sample ({chunks} chunks) at b = {b}, {DEFAULT_MODE} (1 thread)\n\n"
    )
    for part, seconds in breakdown["parts_per_iteration_s"].items():
        text.write(f"  {part:40s} {1e3 * seconds:8.3f} ms/iteration\n")
    text.write("\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(key).print_stats(top)
    return breakdown, text.getvalue()


# ------------------------------------------------------------------ report
def fmt_ms(entry: dict | None) -> str:
    if entry is None:
        return "—"
    ms = 1e3 * entry["median_s"]
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def ratio(num: dict | None, den: dict | None) -> float | None:
    if num is None or den is None:
        return None
    return num["median_s"] / den["median_s"]


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}×"


MET = {True: "**met**", False: "**NOT met**"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: b <= 100, fewer repeats")
    parser.add_argument("--clients", type=int, nargs="+", help="numbers of clients b (default 10 100 1000)")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="kernel gradient modes"
    )
    parser.add_argument("--repeats", type=int, help="timed blocks per measurement (default 7, quick 3)")
    parser.add_argument("--min-block", type=float, help="seconds per timed block (default 0.2, quick 0.05)")
    parser.add_argument(
        "--slow-budget", type=float, default=20.0, help="max seconds of timed blocks per b, traced/eager"
    )
    parser.add_argument("--no-chains", action="store_true", help="skip the 8-chain comparison")
    parser.add_argument(
        "--profile", type=int, metavar="B", help="also write a cProfile of kernel.sample at b = B"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    clients_list = args.clients or ([10, 100] if args.quick else [10, 100, 1000])
    modes = [m for m in MODES if m in args.modes]
    repeats = args.repeats or (3 if args.quick else 7)
    min_block = args.min_block or (0.05 if args.quick else 0.2)
    warmup_chunks = 1
    chain_b = 10 if args.quick else 100  # clients per chain in the chains comparison
    stem = "step_cost_quick" if args.quick else "step_cost"
    started = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    header = (
        f"FALD step cost: logistic regression d={DIM}, {POINTS_PER_CLIENT} points/client (N = 64·b), "
        f"batch {BATCH_SIZE}/client, comm_prob={COMM_PROB}, float32, torch.set_num_threads(1)"
    )
    print(header)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, {platform.processor() or platform.machine()}")
    check = gradient_check()
    print(
        "gradient check (b=10): max |grad| {max_abs_grad:.3g}; max abs diff kernel vs Pyro trace "
        "{kernel_vs_pyro_trace:.2e}, kernel vs hand-written {kernel_vs_hand:.2e}".format(**check)
    )

    rows = []
    for b in clients_list:
        t0 = time.perf_counter()
        problem = Problem(b, args.seed)
        steps = {f"kernel_{mode}": make_kernel_step(problem, args.seed, gradient_mode=mode) for mode in modes}
        steps["hand_written"] = make_hand_step(problem, args.seed)
        if DEFAULT_MODE in modes:  # the same kernel on the model written for NUTS (its data at full size)
            steps["kernel_for_nuts"] = make_kernel_step(problem, args.seed, of=model_for_nuts)
        first_call_s = {mode: steps[f"kernel_{mode}"].first_call_s for mode in modes}
        timings = measure(
            steps,
            repeats=repeats,
            min_block=min_block,
            warmup_chunks=warmup_chunks,
            budgets={f"kernel_{m}": args.slow_budget for m in modes if m != DEFAULT_MODE},
        )
        row = {"b": b, **timings, "kernel_setup_and_first_call_s": first_call_s}
        row["over_hand"] = {mode: ratio(timings[f"kernel_{mode}"], timings["hand_written"]) for mode in modes}
        if "kernel_for_nuts" in timings:
            default = timings[f"kernel_{DEFAULT_MODE}"]
            row["for_nuts_over_subsample"] = ratio(timings["kernel_for_nuts"], default)
        rows.append(row)
        print(
            f"b={b:5d}: "
            + ", ".join(f"{mode} {fmt_ms(timings[f'kernel_{mode}'])} ms" for mode in modes)
            + f", hand-written {fmt_ms(timings['hand_written'])} ms; set-up + first call "
            + ", ".join(f"{mode} {first_call_s[mode]:.1f} s" for mode in modes)
            + f" ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    chains = None
    if not args.no_chains and DEFAULT_MODE in modes:
        t0 = time.perf_counter()
        wide = Problem(NUM_CHAINS * chain_b, args.seed)
        steps = {
            f"kernel_{NUM_CHAINS}_chains_b{chain_b}": make_kernel_step(
                Problem(chain_b, args.seed), args.seed, num_chains=NUM_CHAINS
            ),
            f"kernel_1_chain_b{NUM_CHAINS * chain_b}": make_kernel_step(wide, args.seed),
            f"hand_written_b{NUM_CHAINS * chain_b}": make_hand_step(wide, args.seed),
        }
        first_call_s = {name: step.first_call_s for name, step in steps.items() if name.startswith("kernel")}
        timings = measure(steps, repeats=repeats, min_block=min_block, warmup_chunks=warmup_chunks)
        names = list(timings)
        chains = {
            "num_chains": NUM_CHAINS,
            "b_per_chain": chain_b,
            "b_single": NUM_CHAINS * chain_b,
            "timings": timings,
            "kernel_setup_and_first_call_s": first_call_s,
            "chains_over_single": ratio(timings[names[0]], timings[names[1]]),
        }
        print(
            f"chains: {NUM_CHAINS} chains at b={chain_b} {fmt_ms(timings[names[0]])} ms/iteration "
            "(all chains), "
            f"1 chain at b={NUM_CHAINS * chain_b} {fmt_ms(timings[names[1]])} ms, hand-written "
            f"{fmt_ms(timings[names[2]])} ms ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    profile_b = max(clients_list)
    breakdown, _ = profile_kernel(profile_b, chunks=2 if args.quick else 4, seed=args.seed)

    # -------------------------------------------------------------- markdown
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    load = (
        ""
        if load_start is None
        else f" Machine load (1-min average) {load_start:.1f} at the start, {load_end:.1f} at the end, on "
        f"{os.cpu_count()} CPUs: other processes inflate absolute times; the interleaved ratios move less."
    )
    lines = [
        f"# {header}",
        "",
        f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}; median of {repeats} timed blocks (each a whole "
        f"number of 64-iteration chunks for the kernel){' (quick run)' if args.quick else ''}; "
        f"{datetime.date.today().isoformat()}; {time.perf_counter() - started:.0f} s.{load}",
        "",
        "Milliseconds per iteration (`kernel.sample` call, chunk cost amortised), and the ratio to the "
        "hand-written step:",
        "",
        "| b | hand-written | "
        + " | ".join(
            f"{m}{' (default, steady state)' if m == DEFAULT_MODE else ''} | {m}/hand" for m in modes
        )
        + " |",
        "|---:|---:|" + "---:|---:|" * len(modes),
    ]
    for row in rows:
        lines.append(
            f"| {row['b']} | {fmt_ms(row['hand_written'])} | "
            + " | ".join(f"{fmt_ms(row[f'kernel_{m}'])} | {fmt_ratio(row['over_hand'][m])}" for m in modes)
            + " |"
        )
    nuts_rows = [row for row in rows if "for_nuts_over_subsample" in row]
    if nuts_rows:
        lines += [
            "",
            f"The same kernel ({DEFAULT_MODE}) on the model written for NUTS (the logits at full size, "
            "`obs=y`: each client's potential is the model run on its rows of `x` and `y`), against "
            "the model "
            "read through the plate's indices:",
            "",
            "| b | plate's indices | written for NUTS | ratio |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {row['b']} | {fmt_ms(row[f'kernel_{DEFAULT_MODE}'])} | {fmt_ms(row['kernel_for_nuts'])} | "
            f"{fmt_ratio(row['for_nuts_over_subsample'])} |"
            for row in nuts_rows
        ]
    lines += [
        "",
        "Set-up + first call (seconds: `FaldKernel(...)`, `setup`, the first `sample`, which draws the first "
        "chunk's randomness, traces/compiles the iteration and runs the chunk; TorchInductor caches compiled "
        "code on disk, so a machine's first compilation takes longer):",
        "",
        "| b | " + " | ".join(modes) + " |",
        "|---:|" + "---:|" * len(modes),
    ]
    for row in rows:
        s = row["kernel_setup_and_first_call_s"]
        lines.append(f"| {row['b']} | " + " | ".join(f"{s[m]:.2f}" for m in modes) + " |")
    targets: dict = {"per_b": {}, "chains": None}
    lines += ["", f"Targets (gradient_mode={DEFAULT_MODE!r}, the steady state of the default 'auto'):"]
    for row in rows:
        limit = TARGETS.get(row["b"])
        if limit is None or DEFAULT_MODE not in modes:
            continue
        value = row["over_hand"][DEFAULT_MODE]
        met = value <= limit
        targets["per_b"][row["b"]] = {"at_most": limit, "value": value, "met": met}
        lines.append(
            f"- b = {row['b']}: kernel within {limit:g}× of the hand-written step: {value:.3g}× — {MET[met]}"
        )
    missing = [b for b in TARGETS if b not in targets["per_b"]]
    if missing:
        lines.append(f"- b = {', '.join(map(str, missing))}: not evaluated (not run)")
    if chains is not None:
        names = list(chains["timings"])
        value = chains["chains_over_single"]
        met = value <= 1.0
        targets["chains"] = {"at_most": 1.0, "value": value, "met": met}
        lines.append(
            f"- {NUM_CHAINS} chains at b = {chain_b} cost no more per iteration than one chain at "
            f"b = {NUM_CHAINS * chain_b}: {fmt_ms(chains['timings'][names[0]])} ms vs "
            f"{fmt_ms(chains['timings'][names[1]])} ms = {value:.3g}× — {MET[met]} (hand-written at "
            f"b = {NUM_CHAINS * chain_b}: {fmt_ms(chains['timings'][names[2]])} ms; the {NUM_CHAINS}-chain "
            f"kernel is driven by hand with `kernel.plan = ChainPlan({NUM_CHAINS}, None, None)`, each call "
            f"advancing all {NUM_CHAINS} chains by one iteration)"
        )
    lines += [
        "",
        f"Where the default kernel's time goes at b = {profile_b} (cProfile of {breakdown['iterations']} "
        f"calls, whole chunks; {1e3 * breakdown['wall_per_iteration_s']:.3g} ms/iteration unprofiled wall "
        "time in this pass):",
        "",
        "| part | ms/iteration | share |",
        "|---|---:|---:|",
    ]
    total = breakdown["profiled_per_iteration_s"]
    for part, seconds in breakdown["parts_per_iteration_s"].items():
        lines.append(f"| {part} | {1e3 * seconds:.3g} | {100 * seconds / total:.0f}% |")
    lines += [
        "",
        "Gradient check (b = 10, same points and minibatches): max |grad| {max_abs_grad:.3g}, max abs diff "
        "kernel vs a client-by-client Pyro trace {kernel_vs_pyro_trace:.2e}, kernel vs hand-written "
        "{kernel_vs_hand:.2e}.".format(**check),
        "",
        "Produced by `benchmarks/step_cost.py` (see its docstring for what each column measures).",
    ]
    table = "\n".join(lines) + "\n"
    print()
    print(table)

    result = {
        "benchmark": "step_cost",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "wall_s": time.perf_counter() - started,
        "load_average_1min": [load_start, load_end],
        "cpu_count": os.cpu_count(),
        "config": {
            "dim": DIM,
            "points_per_client": POINTS_PER_CLIENT,
            "batch_size": BATCH_SIZE,
            "step_size": STEP_SIZE,
            "comm_prob": COMM_PROB,
            "noise_corr": NOISE_CORR,
            "modes": modes,
            "default_mode": DEFAULT_MODE,
            "quick": args.quick,
            "repeats": repeats,
            "min_block_s": min_block,
            "slow_budget_s": args.slow_budget,
            "seed": args.seed,
        },
        "gradient_check": check,
        "rows": rows,
        "chains": chains,
        "breakdown": breakdown,
        "targets": targets,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(table)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / (stem + '.md')} and {stem}.json")

    if args.profile:
        _, report = profile_kernel(args.profile, chunks=10, seed=args.seed)
        path = RESULTS / f"step_cost_profile_b{args.profile}.txt"
        path.write_text(report)
        print(report)
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
