"""Cost of FALD on one CUDA GPU: the pyro_fed kernel through ``pyro.infer.MCMC`` against a CUDA-graph floor.

What is measured
----------------
Bayesian logistic regression (``Normal(0, 1)`` prior, ``d = 10`` and ``d = 100`` features, synthetic data,
an i.i.d. partition with 64 points per client, minibatches of 32 points per client, ``comm_prob = 0.5``,
``step_size = 0.01``, float32) at ``b = 10, 10^3, 10^4`` clients, and ``b = 10^5`` with ``d = 100`` (6.4
million points, 2.6 GB of data). For each configuration:

(k) **kernel through MCMC** -- ``MCMC(FaldKernel(model, clients, step_size=0.01, comm_prob=0.5,
    batch_size=32, gradient_mode=...), num_samples=S, warmup_steps=W, disable_progbar=True).run(x, y)``
    with the data on the GPU. The **time per draw** comes from a ``hook_fn`` that time-stamps the draws
    that start a chunk, between the first and the last such draw of the sampling phase: it holds no set-up.
    ``set-up + compile`` is the cold run's time (set-up, tracing, TorchInductor compilation, CUDA-graph
    capture of a full chunk) minus its draws at that rate. For ``b <= 10^4`` the same kernel object also
    runs two warm runs with ``S1`` and ``S2`` draws, and the JSON keeps ``(T(S2) - T(S1)) / (S2 - S1)``
    as a second estimate; it is not the reported one, because each warm run repeats the set-up (the
    potential and the minibatch sampler are rebuilt), and on an H200 that set-up (1.1-1.9 s) varied by
    more than the extra draws took (0.3 s): the difference came out negative. With ``thinning = 10`` each
    draw is 10 iterations, so per-draw / 10 shows the per-iteration cost without most of MCMC's per-draw
    overhead. ``--report RUN.json`` writes the tables of a stored run again.
(c) **8 chains** -- the same with ``MCMC(..., num_chains=8)``: the kernel advances the batched state
    ``[8, b, d]`` during chain 0's run and serves chains 1-7 from its buffers. Two numbers: the cost of one
    iteration of the batched state, timed as in (k) (8 chains advance; it includes MCMC's per-draw work
    for all 8 chains), and the wall time per chain-draw, that divided by 8.
(f) **floor** -- a hand-written batched FALD step in plain torch (per iteration: a fresh per-client
    permutation every local epoch of 2 minibatches, ``argsort`` of ``[C, b, 64]`` uniform keys; gather the
    minibatch rows; logistic gradient by batched ``matmul``; shared noise ``randn``; the coin ``rand() <
    p_c`` as a select between the average and the local iterates; the client average recorded), all
    randomness on the GPU, ``K = 64`` iterations captured as ONE CUDA graph and replayed; per-iteration
    time = replay time / K, with ``torch.cuda.synchronize()`` around the timed replays.
(m) **MCMC loop floor** -- ``MCMC`` with a kernel whose ``sample`` returns its input (one ``[d]`` tensor
    on the GPU): Pyro's own per-draw cost (the generator, the logging hook, the flattening ``torch.cat``,
    the list of draws, the final stack). Near the GPU floor this per-draw Python loop dominates.

Why
---
The chunked engine (randomness drawn a chunk ahead, each iteration one compiled function, a full chunk
replayed as one CUDA graph) aims at the GPU's floor for the tensor work. Targets: the default kernel
(``gradient_mode="compiled"``) within **2x** of the floor for ``b <= 10^4`` (per iteration; reported
with ``thinning = 1``, where MCMC's per-draw loop is included, and with ``thinning = 10``), and 8 chains
within **1.5x** the per-iteration cost of one chain for ``b <= 10^3``. Reported, never enforced.

How
---
One CUDA device, float32, TF32 off. Without CUDA the script prints ``CUDA not available: skipped`` and
exits 0. ``--device cpu --quick`` runs tiny sizes on the CPU (no CUDA graph: the floor runs eagerly) to
smoke-test the script itself; its numbers mean nothing. No configuration starts after ``--budget``
seconds (default 210; the whole run then ends within about a minute): later ones are recorded as
skipped, in the order ``compiled`` (thinning 1, 10, 8 chains), then ``traced``. TorchInductor compiles
each shape once (tens of seconds for a machine's first compilation, then cached on disk).

Run from the repository root (about 4-5 minutes on an H200, most of it compilation)::

    python benchmarks/gpu_step_cost.py            # full run
    python benchmarks/gpu_step_cost.py --quick    # b <= 10^3, fewer draws (about 1-2 minutes)

Results: ``benchmarks/results/gpu_step_cost.md`` and ``gpu_step_cost.json`` (``gpu_step_cost_quick.*`` with
``--quick``; ``--out DIR`` writes them elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

import pyro_fed
from pyro_fed.data import partition

POINTS_PER_CLIENT = 64
BATCH_SIZE = 32
STEP_SIZE = 1e-2
COMM_PROB = 0.5
NUM_CHAINS = 8
GRAPH_ITERATIONS = 64  # K of the floor's CUDA graph
TARGET_FLOOR = 2.0  # kernel / floor, at most, for b <= 10^4
TARGET_FLOOR_MAX_B = 10**4
TARGET_CHAINS = 1.5  # 8-chain iteration / 1-chain iteration, at most, for b <= 10^3
TARGET_CHAINS_MAX_B = 10**3
RESULTS = Path(__file__).resolve().parent / "results"


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    """Bayesian logistic regression; the likelihood is a full-size plate read through its indices."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


class Problem:
    """Synthetic data on ``device``, split i.i.d. into ``b`` clients of 64 points."""

    def __init__(self, num_clients: int, dim: int, device: torch.device, seed: int = 0):
        gen = torch.Generator(device).manual_seed(seed)
        self.b, self.dim, self.device = num_clients, dim, device
        self.num_data = POINTS_PER_CLIENT * num_clients
        self.x = torch.randn(self.num_data, dim, generator=gen, device=device)
        w_true = torch.randn(dim, generator=gen, device=device) / math.sqrt(dim)
        self.y = torch.bernoulli(torch.sigmoid(self.x @ w_true), generator=gen)
        self.clients = partition.iid(self.num_data, num_clients, seed=seed)  # ids on the host
        # [b, 64] data indices of each client (the i.i.d. split gives every client exactly 64 points)
        self.table = self.clients.argsort(stable=True).view(num_clients, POINTS_PER_CLIENT).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ (f) the CUDA-graph floor
class HandFald:
    """Plain-torch FALD for ``C`` chains of ``b`` clients, every randomness drawn on the device; ``K``
    iterations captured as one CUDA graph (on CUDA), replayed."""

    def __init__(self, problem: Problem, num_chains: int, iterations: int = GRAPH_ITERATIONS):
        self.x = problem.x[problem.table]  # [b, 64, d] client-major local data
        self.y = problem.y[problem.table]  # [b, 64]
        b, d, device = problem.b, problem.dim, problem.device
        self.rows = torch.arange(b, device=device)[None, :, None]  # [1, b, 1]
        self.prior_weight = 1.0 / b  # proportional: N_i / N
        self.lik_scale = POINTS_PER_CLIENT / BATCH_SIZE
        self.noise_scale = math.sqrt(2.0 * STEP_SIZE / b)  # tau = 1: one shared noise, variance 1/b
        self.state = torch.zeros(num_chains, b, d, device=device)
        self.iterations = iterations
        self.draws = torch.zeros(iterations, num_chains, d, device=device)
        self.graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._iterate()  # warm-up: allocator, cuBLAS
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._iterate()
        self.replay()

    def _iterate(self) -> None:
        w = self.state
        c, b, d = w.shape
        n_local = POINTS_PER_CLIENT
        perm = None
        for k in range(self.iterations):
            slot = k % (n_local // BATCH_SIZE)
            if slot == 0:  # a new local epoch: every client permutes its data
                perm = torch.rand(c, b, n_local, device=w.device).argsort(-1)
            idx = perm[..., slot * BATCH_SIZE : (slot + 1) * BATCH_SIZE]  # [C, b, n]
            xb = self.x[self.rows, idx]  # [C, b, n, d]
            yb = self.y[self.rows, idx]  # [C, b, n]
            residual = torch.sigmoid(torch.matmul(xb, w.unsqueeze(-1)).squeeze(-1)) - yb
            grad = self.prior_weight * w + self.lik_scale * torch.matmul(residual.unsqueeze(-2), xb).squeeze(
                -2
            )
            noise = torch.randn(c, 1, d, device=w.device)
            proposed = w - STEP_SIZE * grad + self.noise_scale * noise
            coin = torch.rand(c, 1, 1, device=w.device) < COMM_PROB
            w = torch.where(coin, proposed.mean(-2, keepdim=True).expand_as(proposed), proposed)
            self.draws[k].copy_(w.mean(-2))
        self.state.copy_(w)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._iterate()

    def per_iteration(self, device: torch.device, min_seconds: float) -> float:
        """Seconds per iteration: replays timed between synchronisations, at least ``min_seconds``."""
        sync(device)
        start = time.perf_counter()
        self.replay()
        sync(device)
        single = max(time.perf_counter() - start, 1e-6)
        replays = max(3, math.ceil(min_seconds / single))
        sync(device)
        start = time.perf_counter()
        for _ in range(replays):
            self.replay()
        sync(device)
        if not bool(torch.isfinite(self.state).all()):
            raise RuntimeError("floor: non-finite iterate, the step size is unstable for this problem")
        return (time.perf_counter() - start) / (replays * self.iterations)


# ------------------------------------------------------------------ (m) MCMC's own loop
class NullKernel(MCMCKernel):
    """A kernel whose ``sample`` does nothing: ``MCMC``'s own per-draw cost."""

    def __init__(self, dim: int, device: torch.device):
        self.value = torch.zeros(dim, device=device)
        self.transforms = {}

    def setup(self, warmup_steps, *args, **kwargs):
        pass

    @property
    def initial_params(self):
        return {"w": self.value}

    @initial_params.setter
    def initial_params(self, params):
        pass

    def logging(self):
        return OrderedDict()

    def sample(self, params):
        return params


def time_mcmc(kernel, draws: int, warmup: int, num_chains: int, args, hook=None) -> float:
    mcmc = MCMC(
        kernel,
        num_samples=draws,
        warmup_steps=warmup,
        num_chains=num_chains,
        disable_progbar=True,
        hook_fn=hook,
    )
    device = args[0].device
    sync(device)
    start = time.perf_counter()
    mcmc.run(*args)
    sync(device)
    seconds = time.perf_counter() - start
    samples = mcmc.get_samples()["w"]
    if not bool(torch.isfinite(samples).all()):
        raise RuntimeError("non-finite draws: the step size is unstable for this problem")
    return seconds


def mcmc_floor(dim: int, device: torch.device, draws: int) -> float:
    """Seconds per draw of ``MCMC`` around a kernel that does nothing (difference of two runs)."""
    kernel, args = NullKernel(dim, device), (torch.zeros(1, device=device),)
    time_mcmc(kernel, 100, 0, 1, args)
    short = time_mcmc(kernel, draws, 0, 1, args)
    long = time_mcmc(kernel, 5 * draws, 0, 1, args)
    return (long - short) / (4 * draws)


# ------------------------------------------------------------------ (k), (c) the kernel through MCMC
class ChunkClock:
    """``hook_fn`` time-stamping every sampling-phase draw of chain 0 (no synchronisation: the kernel
    waits for the device at the end of each chunk); :meth:`per_draw` then uses the draws that ran a chunk."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.stamps: list[tuple[int, float]] = []

    def __call__(self, kernel, params, stage, i):
        if stage in ("Sample", "Sample [0]"):
            self.stamps.append((self.warmup + i, time.perf_counter()))  # draw index in the chain

    def per_draw(self, per_chunk: int) -> float | None:
        """Seconds per draw between the second and the last sampling-phase draws that ran a chunk (draw
        ``g`` runs one when ``g`` is a multiple of the draws per chunk)."""
        starts = [(g, t) for g, t in self.stamps if g % per_chunk == 0][1:]
        if len(starts) < 2:
            return None
        (d0, t0), (d1, t1) = starts[0], starts[-1]
        return (t1 - t0) / (d1 - d0)


def draws_per_chunk(kernel) -> int:
    return max(1, kernel.runner.chunk // kernel.current_thinning)


def measure_kernel(
    problem: Problem, mode: str, thinning: int, num_chains: int, *, target_s: float, two_runs: bool
) -> dict:
    """The kernel through ``MCMC``: a cold run, then (``two_runs``) two warm runs of different lengths."""
    pyro.set_rng_seed(0)
    kernel = pyro_fed.FaldKernel(
        model,
        problem.clients,
        step_size=STEP_SIZE,
        comm_prob=COMM_PROB,
        batch_size=BATCH_SIZE,
        gradient_mode=mode,
        thinning=thinning,
    )
    args = (problem.x, problem.y)
    per_chunk = max(1, kernel.chunk_size // thinning)  # a guess until the kernel has set up
    cold_warmup, cold_draws = per_chunk, 4 * per_chunk
    clock = ChunkClock(cold_warmup)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a fallback from compiled to traced
        warnings.simplefilter("always")
        cold = time_mcmc(kernel, cold_draws, cold_warmup, num_chains, args, hook=clock)
    for warning in caught:
        print(f"  warning: {warning.message}", flush=True)
    per_chunk = draws_per_chunk(kernel)
    engine = getattr(kernel, "_engine", None)
    prepared = getattr(engine, "_prepared", {})
    result = {
        "mode": mode,
        "thinning": thinning,
        "num_chains": num_chains,
        "draws_per_chunk": per_chunk,
        "cold_run_s": cold,
        "cold_draws": cold_warmup + cold_draws,
        "prepared_modes": sorted({getattr(p, "mode", "?") for p in prepared.values()}),
        "warnings": [str(w.message) for w in caught],
    }
    estimate = clock.per_draw(per_chunk)
    if not two_runs:
        if estimate is None:  # too few chunks in the cold run: time a few in one warm run
            clock = ChunkClock(per_chunk)
            time_mcmc(kernel, 8 * per_chunk, per_chunk, num_chains, args, hook=clock)
            estimate = clock.per_draw(per_chunk)
        result.update(per_draw_hook_s=estimate, method="hook (one run)")
    else:
        warmup = per_chunk
        short = 2 * per_chunk
        # the extra draws span about target_s seconds (from the cold run's rate), in whole chunks
        rate = estimate if estimate is not None else cold / (cold_warmup + cold_draws)
        extra_chunks = min(400, max(4, math.ceil(target_s / max(rate * per_chunk, 1e-7))))
        long = short + extra_chunks * per_chunk
        t_short = time_mcmc(kernel, short, warmup, num_chains, args, hook=ChunkClock(warmup))
        clock = ChunkClock(warmup)
        t_long = time_mcmc(kernel, long, warmup, num_chains, args, hook=clock)
        result.update(
            per_draw_hook_s=clock.per_draw(per_chunk),
            per_draw_two_runs_s=(t_long - t_short) / (long - short),
            method="two warm runs",
            draws=[short, long],
            warm_run_s=[t_short, t_long],
        )
    return settle(result)


def settle(result: dict) -> dict:
    """The row's per-draw time and what follows from it. The time stamps within one run come first: they
    hold no set-up. The difference of two warm runs cancels the set-up only when it repeats to within a
    small part of the extra draws' time; on an H200 each warm run spent 1.1-1.9 s rebuilding the potential
    and the minibatch sampler against 0.3 s of extra draws, and the difference came out negative."""
    per_draw = result.get("per_draw_hook_s")
    if per_draw is None:
        per_draw = result.get("per_draw_two_runs_s")
    result["per_draw_s"] = per_draw
    if per_draw is not None:
        draws = result["cold_draws"]
        result["setup_and_compile_s"] = max(0.0, result["cold_run_s"] - draws * per_draw)
        result["per_iteration_s"] = per_draw / result["thinning"]  # all chains advance one iteration
        result["per_chain_draw_s"] = per_draw / result["num_chains"]
    return result


# ------------------------------------------------------------------ report
def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    ms = 1e3 * seconds
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}×"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


MET = {True: "**met**", False: "**NOT met**"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="b <= 10^3, fewer draws")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the results")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": smoke test only
    parser.add_argument("--modes", nargs="+", default=["compiled", "traced"], choices=["compiled", "traced"])
    parser.add_argument("--dims", type=int, nargs="+", help="feature dimensions (default 10 100)")
    parser.add_argument("--clients", type=int, nargs="+", help="numbers of clients (default 10 1e3 1e4 1e5)")
    parser.add_argument(
        "--budget", type=float, default=210.0, help="seconds after which configurations are skipped"
    )
    parser.add_argument(
        "--report", type=Path, help="measure nothing: report again the run of this JSON (into --out)"
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        return rereport(args.report, args.out)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA not available: skipped")
        return {}
    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    smoke = device.type != "cuda"
    if smoke:
        torch.set_num_threads(1)
    dims = args.dims or ([10] if smoke else [10, 100])
    if args.clients:
        clients_list = args.clients
    elif smoke:
        clients_list = [10, 100]
    else:
        clients_list = [10, 10**3] if args.quick else [10, 10**3, 10**4, 10**5]
    target_s = 0.2 if args.quick or smoke else 0.5
    two_run_max_b = 10**4
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    print(title(device_name))
    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}", flush=True
    )

    configs = []  # (d, b) in increasing cost; b = 10^5 only with d = 100
    for d in dims:
        for b in clients_list:
            if b >= 10**5 and d < 100 and not args.clients:
                continue
            configs.append((d, b))

    def over_budget() -> bool:
        return time.perf_counter() - started > args.budget

    loop_floor = {d: mcmc_floor(d, device, 200 if smoke else 1000) for d in dims}
    print("MCMC loop floor: " + ", ".join(f"d={d} {fmt_ms(s)} ms/draw" for d, s in loop_floor.items()))
    rows, skipped = [], []
    problems: dict[tuple[int, int], Problem] = {}
    plan = []  # (mode, thinning, chains) per config, in priority order
    for mode in args.modes:
        plan += [(mode, 1, 1), (mode, 10, 1), (mode, 1, NUM_CHAINS)]
    for mode, thinning, chains in plan:
        for d, b in configs:
            if chains > 1 and b > TARGET_CHAINS_MAX_B:
                continue
            name = f"{mode}, thinning={thinning}, chains={chains}, d={d}, b={b}"
            if over_budget():
                skipped.append(name)
                continue
            t0 = time.perf_counter()
            try:
                if (d, b) not in problems:
                    problems[(d, b)] = Problem(b, d, device)
                problem = problems[(d, b)]
                entry = measure_kernel(
                    problem, mode, thinning, chains, target_s=target_s, two_runs=b <= two_run_max_b
                )
            except Exception as error:  # out of memory, or a failure of the kernel: recorded, not fatal
                message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
                print(f"{name}: FAILED ({message})", flush=True)
                skipped.append(f"{name} (failed: {message})")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            entry.update(d=d, b=b, wall_s=time.perf_counter() - t0)
            rows.append(entry)
            print(
                f"{name}: {fmt_ms(entry['per_draw_s'])} ms/draw (two runs "
                f"{fmt_ms(entry.get('per_draw_two_runs_s'))}), "
                f"{fmt_ms(entry.get('per_iteration_s'))} ms/iteration, set-up+compile "
                f"{entry.get('setup_and_compile_s', float('nan')):.1f} s ({entry['wall_s']:.0f} s)",
                flush=True,
            )

    floors = {}
    for d, b in configs:
        for chains in (1, NUM_CHAINS):
            if chains > 1 and b > TARGET_CHAINS_MAX_B:
                continue
            if (d, b) not in problems:
                continue
            try:
                floors[(d, b, chains)] = HandFald(problems[(d, b)], chains).per_iteration(
                    device, target_s / 2
                )
            except Exception as error:  # out of memory, or a capture failure: recorded, not fatal
                message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
                skipped.append(f"floor d={d} b={b} chains={chains} (failed: {message})")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                floors[(d, b, chains)] = None
            print(
                f"floor d={d} b={b} chains={chains}: {fmt_ms(floors[(d, b, chains)])} ms/iteration",
                flush=True,
            )

    result = {
        "benchmark": "gpu_step_cost",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pyro": pyro.__version__,
        "python": platform.python_version(),
        "device": device_name,
        "smoke_test": smoke,
        "dtype": "float32",
        "wall_s": time.perf_counter() - started,
        "config": {
            "points_per_client": POINTS_PER_CLIENT,
            "batch_size": BATCH_SIZE,
            "step_size": STEP_SIZE,
            "comm_prob": COMM_PROB,
            "dims": dims,
            "clients": clients_list,
            "configs": configs,
            "modes": args.modes,
            "quick": args.quick,
            "budget_s": args.budget,
            "graph_iterations": GRAPH_ITERATIONS,
        },
        "mcmc_loop_floor_per_draw_s": {str(d): s for d, s in loop_floor.items()},
        "floor_per_iteration_s": [
            {"d": d, "b": b, "num_chains": c, "seconds": s} for (d, b, c), s in floors.items()
        ],
        "kernel": rows,
        "skipped": skipped,
    }
    return write(result, args.out)


def title(device_name: str) -> str:
    return (
        f"FALD on {device_name}: logistic regression, {POINTS_PER_CLIENT} points/client, batch {BATCH_SIZE}, "
        f"comm_prob={COMM_PROB}, float32; kernel through pyro.infer.MCMC vs a hand-written CUDA-graph floor"
    )


def write(result: dict, out: Path) -> dict:
    """The report of a run (:func:`report`, which also sets its ``targets``) and its JSON, in ``out``."""
    table = report(result)
    print()
    print(table)
    stem = "gpu_step_cost_quick" if result["config"]["quick"] else "gpu_step_cost"
    if result["smoke_test"]:
        stem += "_cpu_smoke"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / (stem + '.md')} and {stem}.json")
    return result


def report(result: dict) -> str:
    """The Markdown tables of a run's ``result`` (as :func:`main` measures it); sets ``result["targets"]``."""
    rows, config = result["kernel"], result["config"]
    floors = {(f["d"], f["b"], f["num_chains"]): f["seconds"] for f in result["floor_per_iteration_s"]}
    configs = [tuple(c) for c in config["configs"]]

    def find(mode, thinning, chains, d, b):
        return next(
            (
                r
                for r in rows
                if (r["mode"], r["thinning"], r["num_chains"], r["d"], r["b"])
                == (mode, thinning, chains, d, b)
            ),
            None,
        )

    lines = [
        f"# {title(result['device'])}",
        "",
        f"torch {result['torch']}, pyro {result['pyro']}, Python {result['python']}, {result['device']}"
        f"{' (CPU smoke test: numbers meaningless)' if result['smoke_test'] else ''}"
        f"{' (quick run)' if config['quick'] else ''}; {result['date'][:10]}; "
        f"{result['wall_s']:.0f} s in all.",
        "",
        "MCMC's own loop (a kernel that does nothing): "
        + ", ".join(f"d = {d}: {fmt_ms(s)} ms/draw" for d, s in result["mcmc_loop_floor_per_draw_s"].items())
        + ".",
        "",
    ]
    targets = {"floor": [], "chains": []}
    for mode in config["modes"]:
        lines += [
            f"## gradient_mode={mode!r}" + (" (default)" if mode == "compiled" else ""),
            "",
            "Milliseconds. *per draw*: MCMC wall time per draw (warm; set-up and compilation excluded); "
            "*per it.*: per draw / thinning; *floor*: the hand-written CUDA-graph step per iteration; "
            "*8 chains*: one iteration of the batched `[8, b, d]` state (all 8 chains advance, MCMC's "
            "per-draw work for the 8 chains included) and per chain-draw (that / 8); set-up + compile in "
            "seconds (thinning 1, one chain).",
            "",
            "| d | b | floor | per draw (t=1) | /floor | per it. (t=10) | /floor | 8 chains: per it. "
            "| per chain-draw | 8-chain it. / 1-chain it. | 8-chain floor | set-up + compile s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for d, b in configs:
            one, thin, many = find(mode, 1, 1, d, b), find(mode, 10, 1, d, b), find(mode, 1, NUM_CHAINS, d, b)
            floor, floor8 = floors.get((d, b, 1)), floors.get((d, b, NUM_CHAINS))
            it1 = one and one.get("per_iteration_s")
            it10 = thin and thin.get("per_iteration_s")
            it8 = many and many.get("per_iteration_s")
            chains_ratio = ratio(it8, it1)
            lines.append(
                f"| {d} | {b} | {fmt_ms(floor)} | {fmt_ms(it1)} | {fmt_ratio(ratio(it1, floor))} | "
                f"{fmt_ms(it10)} | {fmt_ratio(ratio(it10, floor))} | {fmt_ms(it8)} | "
                f"{fmt_ms(many and many.get('per_chain_draw_s'))} | {fmt_ratio(chains_ratio)} | "
                f"{fmt_ms(floor8)} | "
                + (f"{one['setup_and_compile_s']:.1f}" if one and "setup_and_compile_s" in one else "—")
                + " |"
            )
            if mode == "compiled" and b <= TARGET_FLOOR_MAX_B:
                for thinning, value in ((1, ratio(it1, floor)), (10, ratio(it10, floor))):
                    if value is not None:
                        targets["floor"].append(
                            {
                                "d": d,
                                "b": b,
                                "thinning": thinning,
                                "value": value,
                                "met": value <= TARGET_FLOOR,
                            }
                        )
            if mode == "compiled" and b <= TARGET_CHAINS_MAX_B and chains_ratio is not None:
                targets["chains"].append(
                    {"d": d, "b": b, "value": chains_ratio, "met": chains_ratio <= TARGET_CHAINS}
                )
        lines.append("")
    lines.append("Targets (gradient_mode='compiled'; reported, not enforced):")
    for t in targets["floor"]:
        lines.append(
            f"- d = {t['d']}, b = {t['b']}, thinning = {t['thinning']}: kernel per iteration within "
            f"{TARGET_FLOOR:g}× of the floor: {t['value']:.3g}× — {MET[t['met']]}"
        )
    for t in targets["chains"]:
        lines.append(
            f"- d = {t['d']}, b = {t['b']}: an iteration of {NUM_CHAINS} chains within {TARGET_CHAINS:g}× "
            f"of an iteration of one chain: {t['value']:.3g}× — {MET[t['met']]}"
        )
    if not targets["floor"] and not targets["chains"]:
        lines.append("- none evaluated")
    if result["skipped"]:
        lines += [
            "",
            f"Skipped (time budget of {config['budget_s']:.0f} s, or memory): "
            + "; ".join(result["skipped"])
            + ".",
        ]
    lines += [
        "",
        "Per draw from the time stamps of the draws that start a chunk within one run (no set-up in it); the "
        "JSON also has, for b ≤ 10^4, the difference of two warm runs of different lengths, which the "
        "set-up's variation between runs can swamp on a GPU.",
        "",
        "Produced by `benchmarks/gpu_step_cost.py` (see its docstring for what each column measures)"
        + (
            f"; reported again on {result['reported_again']} from the run's JSON (`--report`), whose own "
            "table took the two-run difference."
            if "reported_again" in result
            else "."
        ),
    ]
    result["targets"] = targets
    return "\n".join(lines) + "\n"


def rereport(path: Path, out: Path) -> dict:
    """Report again a run's JSON (as :func:`main` writes it) with the estimates :func:`settle` chooses now."""
    result = json.loads(path.read_text())
    result["reported_again"] = datetime.date.today().isoformat()
    for row in result["kernel"]:
        settle(row)
    return write(result, out)


if __name__ == "__main__":
    main()
    sys.exit(0)
