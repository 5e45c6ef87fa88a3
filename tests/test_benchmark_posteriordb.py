"""Smoke test of benchmarks/posteriordb.py: the shipped posteriors' models, one translation checked against
its Stan program by hand, and the harness's rows at a tiny size."""

import importlib.util
import json
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch
from pyro import poutine
from pyro.distributions import Unit
from pyro.infer import MCMC
from pyro.poutine.util import site_is_subsample

import pyro_fed

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("posteriordb_benchmark", BENCHMARKS / "posteriordb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCHMARKS / "posteriordb"))  # the harness puts its models' folder first


def test_shipped_files_and_licence(harness):
    shipped = BENCHMARKS / "posteriordb"
    assert len(harness.POSTERIORS) >= 15
    assert "BSD 3-Clause" in (shipped / "LICENCE.md").read_text()
    assert json.loads((shipped / "SOURCE.json").read_text())["commit"].startswith("28f8d3d")
    for name, posterior in harness.POSTERIORS.items():
        assert (shipped / "stan" / f"{posterior.stan_model}.stan").exists()
        reference = json.loads((shipped / "reference" / f"{name}.json").read_text())["parameters"]
        for stats in reference.values():
            assert stats["sd"] > 0 and stats["ess_bulk"] > 1000


def test_every_model_traces_on_its_data(harness):
    """Each model runs on its shipped data with every Stan parameter as a site of the right size (or a
    transformed parameter of them), the observed data in the plate "data", and a finite log density at the
    reference mean."""
    for name in harness.POSTERIORS:
        posterior, args, reference = harness.load(name, torch.float64)
        means: dict[str, dict] = {}  # site: {index: the reference mean}
        for stan_name, stats in reference.items():
            site, index = harness.stan_site(stan_name)
            means.setdefault(site, {})[index] = stats["mean"]
        values = {
            site: torch.tensor(m[None] if None in m else [m[i] for i in range(len(m))], dtype=torch.float64)
            for site, m in means.items()
        }
        trace = poutine.trace(poutine.condition(posterior.model, data=values)).get_trace(*args)
        sites = {k: s for k, s in trace.nodes.items() if s["type"] == "sample" and not site_is_subsample(s)}
        # the parameters (conditioned here, so marked observed): the sites outside the plate but factors
        latent = {
            k
            for k, s in sites.items()
            if not any(f.name == "data" for f in s["cond_indep_stack"]) and not isinstance(s["fn"], Unit)
        }
        # the reference's parameters are the model's sites, or the program's transformed parameters of them
        derived = set()
        if posterior.transformed is not None:
            derived = set(posterior.transformed({k: sites[k]["value"] for k in latent}))
        assert set(means) <= latent | derived, name
        if not derived:
            assert latent == set(means), name
        plated = [s for s in sites.values() if any(f.name == "data" for f in s["cond_indep_stack"])]
        assert plated and plated[0]["value"].shape[0] == args[0].shape[0], name
        assert math.isfinite(float(trace.log_prob_sum())), name


def stan_kidscore_momhs(kid_score, mom_hs, beta, sigma):
    """The log density of Stan's kidscore_momhs, by hand (up to a constant): ``sigma ~ cauchy(0, 2.5)``,
    ``kid_score ~ normal(beta[1] + beta[2] * mom_hs, sigma)``, ``beta`` flat."""
    mu = beta[0] + beta[1] * mom_hs
    likelihood = np.sum(-np.log(sigma) - 0.5 * ((kid_score - mu) / sigma) ** 2)
    return likelihood - np.log1p((sigma / 2.5) ** 2)


def stan_low_dim_gauss_mix(y, mu, sigma, theta):
    """Stan's low_dim_gauss_mix by hand (up to a constant)."""
    prior = -0.5 * np.sum((np.asarray(mu) / 2) ** 2) - 0.5 * np.sum((np.asarray(sigma) / 2) ** 2)
    prior += 4 * np.log(theta) + 4 * np.log(1 - theta)  # beta(5, 5)
    parts = [
        w * np.exp(-0.5 * ((y - m) / s) ** 2) / s
        for w, m, s in zip((theta, 1 - theta), mu, sigma, strict=True)
    ]
    return prior + np.sum(np.log(parts[0] + parts[1]))


@pytest.mark.parametrize(
    "name, points, by_hand",
    [
        (
            "kidiq-kidscore_momhs",
            [{"beta": [78.0, 11.5], "sigma": 19.8}, {"beta": [70.0, 15.0], "sigma": 25.0}],
            lambda data, p: stan_kidscore_momhs(
                np.array(data["kid_score"]), np.array(data["mom_hs"]), p["beta"], p["sigma"]
            ),
        ),
        (
            "low_dim_gauss_mix-low_dim_gauss_mix",
            [
                {"mu": [-2.7, 2.9], "sigma": [1.0, 1.1], "theta": 0.62},
                {"mu": [-1.0, 0.5], "sigma": [2.0, 0.7], "theta": 0.3},
            ],
            lambda data, p: stan_low_dim_gauss_mix(np.array(data["y"]), p["mu"], p["sigma"], p["theta"]),
        ),
    ],
)
def test_translation_matches_the_stan_program(harness, name, points, by_hand):
    """The Pyro model's log density (constrained scale, as Stan's ``target`` without Jacobians) differs
    from the hand-written one by the same constant at two points."""
    posterior, args, _ = harness.load(name, torch.float64)
    data = json.loads((BENCHMARKS / "posteriordb" / "data" / f"{posterior.data_name}.json").read_text())
    differences = []
    for point in points:
        values = {k: torch.tensor(v, dtype=torch.float64) for k, v in point.items()}
        trace = poutine.trace(poutine.condition(posterior.model, data=values)).get_trace(*args)
        differences.append(float(trace.log_prob_sum()) - by_hand(data, point))
    assert differences[0] == pytest.approx(differences[1], abs=1e-6)


def test_every_model_written_for_nuts_has_the_potential_of_its_subsample_form(harness):
    """The table's ``--written-for-nuts`` rows: each model with its data read at full size is run on each
    client's rows of its arguments, and its clients' gradients and potentials are those of the model read
    through the plate's indices, to rounding."""
    for name in harness.POSTERIORS:
        posterior, args, _ = harness.load(name, torch.float64)
        clients = harness.split(posterior, args, "iid")
        potentials = [
            pyro_fed.FederatedPotential(model, args, clients=clients, gradient_mode="eager")
            for model in (posterior.model, harness.written_for_nuts(posterior.model))
        ]
        assert potentials[0].sites.rows is None and potentials[1].sites.rows is not None, name
        b, d = potentials[0].num_clients, potentials[0].dim
        points = 0.1 * torch.randn(2, b, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        points = points + potentials[0].initial_flat
        grads = [pot.client_grads(points, pot.full_batches) for pot in potentials]
        values = [pot.total_potentials(points[:, 0]) for pot in potentials]
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-10, msg=name)
        torch.testing.assert_close(values[1], values[0], rtol=1e-10, atol=1e-10, msg=name)


def test_stan_start_never_samples_an_improper_prior(harness):
    site = {"fn": pyro.distributions.ImproperUniform(pyro.distributions.constraints.ordered_vector, (), (3,))}
    value = harness.init_to_stan_uniform(site)
    assert value.shape == (3,) and bool((value[1:] > value[:-1]).all())


def test_harness_rows_at_a_tiny_size(harness, tmp_path):
    """Two posteriors, one kernel and NUTS, tiny chains: every row has its fields, and a crash would be a
    row, not an exception."""
    threads = torch.get_num_threads()
    rows = harness.main(
        [
            "--posteriors",
            "kidiq-kidscore_momhs,arK-arK",
            "--kernels",
            "FALD,NUTS",
            "--chains",
            "2",
            "--warmup",
            "20",
            "--samples",
            "30",
            "--out",
            str(tmp_path),
        ]
    )
    assert torch.get_num_threads() == threads
    assert [(r["posterior"], r["sampler"]) for r in rows] == [
        ("kidiq-kidscore_momhs", "FALD"),
        ("kidiq-kidscore_momhs", "NUTS"),
        ("arK-arK", "FALD"),
        ("arK-arK", "NUTS"),
    ]
    for row in rows:
        assert isinstance(row["passes"], bool) and "warnings" in row
        if row["error"] is None:
            for key in ("mean_err", "sd_ratio", "rhat", "ess", "seconds", "ess_per_s", "failed"):
                assert key in row, (row["sampler"], key)
            assert set(row["parameters"]) == set(harness.load(row["posterior"])[2])
        else:
            assert row["error"].split(":")[0].isidentifier()
    saved = json.loads((tmp_path / "posteriordb.json").read_text())
    assert len(saved["rows"]) == 4 and saved["info"]["chains"] == 2
    text = (tmp_path / "posteriordb.md").read_text()
    assert "| kidiq-kidscore_momhs | FALD |" in text and "| arK-arK | NUTS |" in text
    # a second run of FALD on arK (here: the same row, its time doubled) replaces the first one's
    again = {"rows": [dict(r, seconds=2 * r["seconds"]) for r in saved["rows"][2:3]], "info": saved["info"]}
    (tmp_path / "again.json").write_text(json.dumps(again))
    merged = harness.main(
        [
            "--merge",
            str(tmp_path / "posteriordb.json"),
            str(tmp_path / "again.json"),
            "--out",
            str(tmp_path / "m"),
        ]
    )
    assert [(r["posterior"], r["sampler"]) for r in merged] == [(r["posterior"], r["sampler"]) for r in rows]
    assert merged[2]["seconds"] == 2 * rows[2]["seconds"] and merged[3]["seconds"] == rows[3]["seconds"]
    assert "Written by 2 runs" in (tmp_path / "m" / "posteriordb.md").read_text()
    # a merged table merged again keeps its runs' commands as they were shortened, and counts its runs
    harness.main(
        [
            "--merge",
            str(tmp_path / "m" / "posteriordb.json"),
            str(tmp_path / "again.json"),
            "--out",
            str(tmp_path),
        ]
    )
    text = (tmp_path / "posteriordb.md").read_text()
    # the three runs' commands and the merge's
    assert "Written by 3 runs" in text and text.count("`python benchmarks/posteriordb.py") == 3 + 1
    assert "posteriors> posteriors>" not in text
    # of a run on another split only the NUTS rows (the pooled data, whatever the split) are taken
    other = {"rows": [dict(r, seconds=3 * r["seconds"]) for r in saved["rows"]], "info": saved["info"]}
    other["info"] = dict(saved["info"], split="sorted")
    (tmp_path / "sorted.json").write_text(json.dumps(other))
    merged = harness.main(
        ["--merge", str(tmp_path / "sorted.json"), str(tmp_path / "posteriordb.json"), "--out", str(tmp_path)]
    )
    seconds = {(r["posterior"], r["sampler"]): r["seconds"] for r in saved["rows"]}
    for row in merged:
        factor = 1 if row["sampler"] == "NUTS" else 3
        assert row["seconds"] == factor * seconds[row["posterior"], row["sampler"]]
    assert (tmp_path / "posteriordb_sorted.md").exists()


def test_the_rows_written_for_nuts_have_their_own_table(harness, tmp_path):
    options = ["--quick", "--posteriors", "arK-arK", "--kernels", "FALD", "--chains", "2", "--warmup", "20"]
    rows = harness.main([*options, "--samples", "30", "--written-for-nuts", "--out", str(tmp_path)])
    assert rows[0]["error"] is None, rows[0]["error"]
    saved = json.loads((tmp_path / "posteriordb_quick_written_for_nuts.json").read_text())
    assert saved["info"]["written_for_nuts"] is True
    assert "the models written for NUTS" in (tmp_path / "posteriordb_quick_written_for_nuts.md").read_text()


def test_a_crash_is_a_row(harness, monkeypatch):
    def broken(model, clients):
        raise RuntimeError("no kernel today\nsecond line")

    monkeypatch.setitem(harness.KERNELS, "FALD", broken)
    (row,) = harness.run_benchmark(["arK-arK"], ["FALD"], chains=2, warmup=5, samples=5)
    assert row["passes"] is False and row["error"] == "RuntimeError: no kernel today"


@pytest.mark.slow
def test_fsglds_eight_schools_failure_is_named_before_the_draws(harness):
    # the benchmark's one FSGLD failure: the warm-up's draws (the windowed adaptation) make its step several
    # times smaller, and the thinning, chosen before them and kept, then leaves a few independent draws per
    # chain at most; a warning says so before the sampling, with the thinning that would do (the run's
    # bulk ESS is not compared with the count: at a few draws in all, ESS estimates are at their floor)
    posterior, args, _ = harness.load("eight_schools-eight_schools_noncentered")
    pyro.set_rng_seed(0)
    kernel = pyro_fed.FsgldKernel(posterior.model, 4)
    mcmc = MCMC(kernel, num_samples=1000, warmup_steps=500, num_chains=4, disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
    counted = [str(w.message) for w in caught if "iterations apart" in str(w.message)]
    assert len(counted) == 1, counted  # said once (again only had a later window made it worse)
    warned = float(re.search(r"about ([0-9.e+-]+) independent draws per chain", counted[0]).group(1))
    suggested = int(re.search(r"thinning=(\d+)", counted[0]).group(1))
    assert warned < 10 and suggested > kernel.current_thinning
    # the run's own count, at its last step, is no better hidden than the one said
    final = 1000 * kernel.current_thinning / kernel.adaptation.relaxation / 2
    assert final >= warned * (1 - 1e-3)
