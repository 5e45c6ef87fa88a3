"""Cost of one FALD iteration: the pyro_fed kernel against a Python loop and a hand-written torch step.

What is measured
----------------
Wall-clock time of **one FALD iteration** (ALGORITHMS.md §1: fresh minibatch gradient of every client,
correlated Langevin noise, one communication coin, averaging when it lands heads, the reported client
average) for Bayesian logistic regression with ``d = 10`` features, a ``Normal(0, 1)`` prior on the
weights, synthetic data, an i.i.d. partition with 64 points per client (``N = 64 b``) and minibatches of 32
points per client, at ``b = 1, 10, 100, 1000`` clients, for three implementations of the same update:

(k) **kernel** -- the library: ``pyro_fed.FaldKernel(model, clients, step_size, comm_prob=0.5,
    batch_size=32)``; after ``kernel.setup(warmup_steps=0, x, y)`` and a few warm-up calls, the time of
    ``kernel.sample(params)``, which is exactly what :class:`pyro.infer.MCMC` calls once per iteration. This
    includes the kernel's bookkeeping (minibatch sampler, finite-check and revert, dispersion, per-draw
    record, bit accounting, building the returned ``params`` dict). Three gradient modes are timed: the
    default ``gradient_mode="traced"``, ``"compiled"`` (the traced graph compiled by TorchInductor) and
    ``"eager"`` (the vmapped Pyro model at every call); the JSON records the one-off cost of ``setup`` plus
    the first call (which traces, and compiles, the gradient).
(a) **python-loop** -- the same Pyro model evaluated client by client: for each client,
    ``poutine.scale(poutine.condition(model, data={"w": w_i, "data": idx_i}), N_i / N)``, then
    ``-trace.log_prob_sum()`` (the plate scales the minibatch by ``N / n`` and the outer scale turns that
    into ``N_i / n`` for the likelihood and ``N_i / N`` -- the proportional prior weight -- for the prior)
    and ``torch.autograd.grad``; then the same batched noise / coin / averaging update. Pyro validation is
    off, as it is inside the kernel, so the comparison is about the loop, not about argument checks.
(b) **hand-written** -- the fastest reasonable plain-torch code for this model: the clients' data stored
    client-major, minibatches without replacement by walking a per-client permutation redrawn once per
    local epoch (the kernel's scheme: one ``argsort`` of ``[b, 64]`` random keys every 2 iterations, then
    one ``index_select`` of the permuted epoch and views), the logistic gradient written by hand as batched
    ops over ``[b, n, d]`` (``bmm``, ``sigmoid``, ``baddbmm``), noise, a host coin and averaging. No Pyro,
    no bookkeeping.

A gradient cross-check on one set of minibatches confirms that the three compute the same client
gradients before anything is timed.

Why
---
DESIGN.md ("Performance principles") asks that one iteration be a handful of batched tensor ops and one
vectorised model evaluation, never a Python loop over clients. The target checked here is that at
``b = 100`` the kernel is at least 20x faster than the Python loop (a) and within 3x of the hand-written
step (b). The script reports whether each target is met; it never fails on them.

How
---
Single-threaded (``torch.set_num_threads(1)``), float32, CPU. Each measurement follows ``timeit``: a few
warm-up calls, then ``repeats`` timed blocks of ``number`` consecutive iterations each (``number`` chosen
so that a block lasts at least ``--min-block`` seconds), reporting the median over blocks of the
per-iteration time. The blocks of the three implementations are interleaved, so that a change in machine
load (other processes) hits all of them alike; absolute times still move with the load, the ratios much
less. The garbage collector stays enabled (as in a real MCMC run). The Python loop gets at most
``--loop-budget`` seconds per ``b``: when even the minimum (3 single-iteration blocks) would exceed it, it
is skipped and its cost extrapolated linearly in ``b`` from the largest measured ``b`` (marked "est.").

Run from the repository root::

    python benchmarks/step_cost.py            # full run, b = 1, 10, 100, 1000 (~1 min)
    python benchmarks/step_cost.py --quick    # smoke run, b <= 100, fewer repeats
    python benchmarks/step_cost.py --profile 100   # also cProfile kernel.sample at b = 100

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
from pyro_fed import partition

DIM = 10
POINTS_PER_CLIENT = 64
BATCH_SIZE = 32
STEP_SIZE = 1e-2  # stable: local Lipschitz constant ~ 64/4 per client, 16 * 0.01 << 2
COMM_PROB = 0.5
NOISE_CORR = 1.0  # the kernel's default tau
TARGET_LOOP_OVER_KERNEL = 20.0
TARGET_KERNEL_OVER_HAND = 3.0
TARGET_B = 100
RESULTS = Path(__file__).resolve().parent / "results"


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    """Bayesian logistic regression; the likelihood is a full-size plate read through its indices."""
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[-1], dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


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


# ------------------------------------------------------------------ shared FALD update (a) and (b)
class FaldUpdate:
    """Noise, coin and averaging of FALD given the clients' gradients (ALGORITHMS.md §1)."""

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


# ------------------------------------------------------------------ (k) the library kernel
def make_kernel_step(problem: Problem, seed: int, **options) -> Callable[[], object]:
    """``kernel.sample`` as MCMC calls it; ``step.first_call_s`` is the one-off cost of ``setup`` and the
    first iteration (which includes tracing the gradient, when the kernel traces it)."""
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    kernel = pyro_fed.FaldKernel(
        model, problem.clients, step_size=STEP_SIZE, comm_prob=COMM_PROB, batch_size=BATCH_SIZE, **options
    )
    kernel.setup(0, problem.x, problem.y)
    params = kernel.sample(kernel.initial_params)
    first_call_s = time.perf_counter() - start

    def step():
        nonlocal params
        params = kernel.sample(params)
        return params["w"]

    step.kernel = kernel
    step.first_call_s = first_call_s
    return step


# ------------------------------------------------------------------ (a) Python loop over clients
def pyro_client_grad(problem: Problem, w: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Minibatch gradient of one client's potential, from a Pyro trace of the model."""
    w = w.detach().requires_grad_(True)
    conditioned = poutine.condition(model, data={"w": w, "data": indices})
    trace = poutine.trace(poutine.scale(conditioned, scale=scale)).get_trace(problem.x, problem.y)
    (grad,) = torch.autograd.grad(-trace.log_prob_sum(), w)
    return grad


def make_loop_step(problem: Problem, seed: int) -> Callable[[], torch.Tensor]:
    update = FaldUpdate(problem.b, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    scales = [float(n) / problem.num_data for n in problem.sizes]
    clients = problem.initial.clone()

    def step():
        nonlocal clients
        grads = []
        with pyro.validation_enabled(False):
            for i, ix in enumerate(problem.client_indices):
                batch = ix[torch.randperm(len(ix), generator=gen)[:BATCH_SIZE]]
                grads.append(pyro_client_grad(problem, clients[i], batch, scales[i]))
        clients, draw = update(clients, torch.stack(grads))
        return draw

    return step


# ------------------------------------------------------------------ (b) hand-written batched torch
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

    return step


# ------------------------------------------------------------------ checks and timing
def gradient_check(b: int = 10, seed: int = 1) -> dict[str, float]:
    """Max abs difference of the kernel's (vmapped Pyro), the loop's and the hand-written client gradients
    on the same points and minibatches."""
    problem = Problem(b, seed)
    gen = torch.Generator().manual_seed(seed)
    points = torch.randn(b, DIM, generator=gen)
    cols = torch.rand(b, POINTS_PER_CLIENT, generator=gen).argsort(1)[:, :BATCH_SIZE]
    global_idx = problem.table.gather(1, cols)
    kernel = make_kernel_step(problem, seed).kernel
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
    scale = float(k_grads.abs().max())
    return {
        "max_abs_grad": scale,
        "kernel_vs_loop": float((k_grads - loop_grads).abs().max()),
        "kernel_vs_hand": float((k_grads - h_grads).abs().max()),
    }


def measure(
    steps: dict[str, Callable[[], object]],
    *,
    repeats: int,
    min_block: float,
    warmup: int,
    budgets: dict[str, float] | None = None,
) -> dict[str, dict]:
    """``timeit``-style: for each implementation, ``repeats`` blocks of ``number`` calls (``number`` such that
    a block lasts ``min_block`` seconds, fewer blocks and calls when ``budgets[name]`` seconds would be
    exceeded, but at least 3 blocks); the median per-call seconds over blocks.

    The blocks of the implementations are interleaved (kernel block, hand-written block, loop block, kernel
    block, ...) so that a change in machine load affects all of them alike and the ratios stay meaningful.
    """
    budgets = budgets or {}
    plan = {}
    for name, step in steps.items():
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        step()
        single = max(time.perf_counter() - start, 1e-7)
        number, reps = max(1, math.ceil(min_block / single)), repeats
        budget = budgets.get(name)
        if budget is not None and reps * number * single > budget:
            number = max(1, math.floor(budget / (reps * single)))
            reps = max(3, min(reps, math.floor(budget / (number * single))))
        plan[name] = (number, reps)
    per_call: dict[str, list[float]] = {name: [] for name in steps}
    for block in range(max(reps for _, reps in plan.values())):
        for name, step in steps.items():
            number, reps = plan[name]
            if block >= reps:
                continue
            start = time.perf_counter()
            for _ in range(number):
                out = step()
            per_call[name].append((time.perf_counter() - start) / number)
            if block == 0 and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
                raise RuntimeError(f"{name}: non-finite draw, the step size is unstable for this problem")
    return {
        name: {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "repeats": len(times),
            "number": plan[name][0],
            "per_call_s": times,
        }
        for name, times in per_call.items()
    }


def profile_kernel(b: int, iterations: int, seed: int, top: int = 25) -> str:
    """cProfile of ``iterations`` calls of ``kernel.sample`` at ``b`` clients (after warm-up)."""
    step = make_kernel_step(Problem(b, seed), seed)
    for _ in range(10):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iterations):
        step()
    profiler.disable()
    text = io.StringIO()
    text.write(f"cProfile of {iterations} x kernel.sample at b = {b} (1 thread)\n\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(key).print_stats(top)
    return text.getvalue()


def fmt_ms(entry: dict | None) -> str:
    if entry is None:
        return "—"
    ms = 1e3 * entry["median_s"]
    value = f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"
    return f"~{value} (est.)" if entry.get("estimated") else value


def ratio(num: dict | None, den: dict | None) -> float | None:
    if num is None or den is None:
        return None
    return num["median_s"] / den["median_s"]


def fmt_ratio(value: float | None, estimated: bool = False) -> str:
    if value is None:
        return "—"
    return f"~{value:.3g}× (est.)" if estimated else f"{value:.3g}×"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: b <= 100, fewer repeats")
    parser.add_argument("--clients", type=int, nargs="+", help="numbers of clients b (default 1 10 100 1000)")
    parser.add_argument("--repeats", type=int, help="timed blocks per measurement (default 7, quick 3)")
    parser.add_argument("--min-block", type=float, help="seconds per timed block (default 0.2, quick 0.05)")
    parser.add_argument("--loop-budget", type=float, default=30.0, help="max seconds for (a) per b")
    parser.add_argument("--profile", type=int, metavar="B", help="also cProfile kernel.sample at b = B")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    clients_list = args.clients or ([1, 10, 100] if args.quick else [1, 10, 100, 1000])
    repeats = args.repeats or (3 if args.quick else 7)
    min_block = args.min_block or (0.05 if args.quick else 0.2)
    warmup = 3 if args.quick else 5
    stem = "step_cost_quick" if args.quick else "step_cost"

    header = (
        f"FALD step cost: logistic regression d={DIM}, {POINTS_PER_CLIENT} points/client (N = 64·b), "
        f"batch {BATCH_SIZE}/client, comm_prob={COMM_PROB}, float32, torch.set_num_threads(1)"
    )
    print(header)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, {platform.processor() or platform.machine()}")
    check = gradient_check()
    print(
        "gradient check (b=10): max |grad| {max_abs_grad:.3g}; max abs diff kernel vs loop "
        "{kernel_vs_loop:.2e}, kernel vs hand-written {kernel_vs_hand:.2e}".format(**check)
    )

    rows, loop_per_client = [], None
    for b in clients_list:
        t0 = time.perf_counter()
        problem = Problem(b, args.seed)
        steps = {
            "kernel": make_kernel_step(problem, args.seed),
            "hand_written": make_hand_step(problem, args.seed),
        }
        steps["kernel_compiled"] = make_kernel_step(problem, args.seed, gradient_mode="compiled")
        steps["kernel_eager"] = make_kernel_step(problem, args.seed, gradient_mode="eager")
        first_call_s = {name: step.first_call_s for name, step in steps.items() if name.startswith("kernel")}
        loop_minimum = (warmup + 1 + 3) * (loop_per_client or 0.0) * b  # warm-up + calibration + 3 blocks
        loop = None
        if loop_per_client is not None and loop_minimum > args.loop_budget:
            loop = {"median_s": loop_per_client * b, "estimated": True}
        else:
            steps["python_loop"] = make_loop_step(problem, args.seed)
        timings = measure(
            steps,
            repeats=repeats,
            min_block=min_block,
            warmup=warmup,
            budgets={"python_loop": args.loop_budget},
        )
        kernel, hand = timings["kernel"], timings["hand_written"]
        if loop is None:
            loop = timings["python_loop"]
            loop_per_client = loop["median_s"] / b
        eager, compiled = timings["kernel_eager"], timings["kernel_compiled"]
        rows.append(
            {
                "b": b,
                "kernel": kernel,
                "python_loop": loop,
                "hand_written": hand,
                "kernel_eager": eager,
                "kernel_compiled": compiled,
                "kernel_setup_and_first_call_s": first_call_s,
            }
        )
        print(
            f"b={b:5d}: kernel {fmt_ms(kernel)} ms (compiled {fmt_ms(compiled)}, eager {fmt_ms(eager)} ms), "
            f"loop {fmt_ms(loop)} ms, "
            f"hand {fmt_ms(hand)} ms; kernel setup + first call {1e3 * first_call_s['kernel']:.0f} ms "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )

    lines = [
        f"# {header}",
        "",
        f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}; median of {repeats} timed blocks"
        f"{' (quick run)' if args.quick else ''}; {datetime.date.today().isoformat()}.",
        "",
        "| b | kernel ms/iter | python-loop ms/iter | hand-written ms/iter | loop/kernel "
        "| kernel/hand-written | compiled kernel ms/iter | compiled/hand-written | eager kernel ms/iter |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        loop_est = bool(row["python_loop"].get("estimated"))
        row["loop_over_kernel"] = ratio(row["python_loop"], row["kernel"])
        row["kernel_over_hand"] = ratio(row["kernel"], row["hand_written"])
        row["compiled_over_hand"] = ratio(row["kernel_compiled"], row["hand_written"])
        lines.append(
            f"| {row['b']} | {fmt_ms(row['kernel'])} | {fmt_ms(row['python_loop'])} | "
            f"{fmt_ms(row['hand_written'])} | {fmt_ratio(row['loop_over_kernel'], loop_est)} | "
            f"{fmt_ratio(row['kernel_over_hand'])} | {fmt_ms(row['kernel_compiled'])} | "
            f"{fmt_ratio(row['compiled_over_hand'])} | {fmt_ms(row['kernel_eager'])} |"
        )
    lines.append("")
    targets = {}
    target_row = next((r for r in rows if r["b"] == TARGET_B), None)
    if target_row is None:
        lines.append(f"Targets at b = {TARGET_B}: not evaluated (b = {TARGET_B} not run).")
    else:
        loop_kernel, kernel_hand = target_row["loop_over_kernel"], target_row["kernel_over_hand"]
        compiled_hand = target_row["compiled_over_hand"]
        targets = {
            "loop_over_kernel_at_least": TARGET_LOOP_OVER_KERNEL,
            "loop_over_kernel": loop_kernel,
            "loop_over_kernel_met": loop_kernel >= TARGET_LOOP_OVER_KERNEL,
            "kernel_over_hand_at_most": TARGET_KERNEL_OVER_HAND,
            "kernel_over_hand": kernel_hand,
            "kernel_over_hand_met": kernel_hand <= TARGET_KERNEL_OVER_HAND,
            "compiled_over_hand": compiled_hand,
            "compiled_over_hand_met": compiled_hand <= TARGET_KERNEL_OVER_HAND,
        }
        met = {True: "**met**", False: "**NOT met**"}
        lines += [
            f"Targets at b = {TARGET_B}:",
            f"- kernel ≥ {TARGET_LOOP_OVER_KERNEL:g}× faster than the Python loop: {loop_kernel:.3g}× — "
            f"{met[targets['loop_over_kernel_met']]}"
            + (
                " (Python-loop time estimated, not measured)"
                if target_row["python_loop"].get("estimated")
                else ""
            ),
            f"- kernel within {TARGET_KERNEL_OVER_HAND:g}× of the hand-written step: {kernel_hand:.3g}× — "
            f"{met[targets['kernel_over_hand_met']]} with the default gradient_mode='traced'; "
            f"{compiled_hand:.3g}× — {met[targets['compiled_over_hand_met']]} with gradient_mode='compiled' "
            f"(after {target_row['kernel_setup_and_first_call_s']['kernel_compiled']:.1f} s of set-up and "
            "compilation in this run; TorchInductor caches compiled code, so a machine's first compilation "
            "takes longer)",
        ]
    lines += [
        "",
        "Gradient check (b = 10, same points and minibatches): max |grad| {max_abs_grad:.3g}, max abs diff "
        "kernel vs loop {kernel_vs_loop:.2e}, kernel vs hand-written {kernel_vs_hand:.2e}.".format(**check),
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
        "config": {
            "dim": DIM,
            "points_per_client": POINTS_PER_CLIENT,
            "batch_size": BATCH_SIZE,
            "step_size": STEP_SIZE,
            "comm_prob": COMM_PROB,
            "noise_corr": NOISE_CORR,
            "quick": args.quick,
            "repeats": repeats,
            "min_block_s": min_block,
            "loop_budget_s": args.loop_budget,
            "seed": args.seed,
        },
        "gradient_check": check,
        "rows": rows,
        "targets": targets,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(table)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / (stem + '.md')} and {stem}.json")

    if args.profile:
        report = profile_kernel(args.profile, iterations=200, seed=args.seed)
        path = RESULTS / f"step_cost_profile_b{args.profile}.txt"
        path.write_text(report)
        print(report)
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
