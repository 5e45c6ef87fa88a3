r"""Regenerate the files of this folder from a clone of ``stan-dev/posteriordb`` (not needed to run the
benchmark, which reads only the files written here).

For every posterior of :data:`models.POSTERIORS` it writes

- ``data/<data set>.json``: the fields the benchmark's programs read, from
  ``posterior_database/data/data/<data set>.json.zip`` (one file per data set, shared by its posteriors),
  gzipped (``.json.gz``) where the text is over :data:`GZIP_BYTES`;
- ``reference/<posterior>.json``: per Stan parameter, the mean, the sd (denominator ``n - 1``) and the bulk
  and tail effective sample sizes (ArviZ, over the reference's 10 chains of 1,000 draws) of the reference
  draws ``posterior_database/reference_posteriors/draws/draws/<posterior>.json.zip``, with their number;
- ``stan/<model>.stan``: the Stan program, for reading beside its translation in ``models.py``;

and copies ``LICENCE.md`` (BSD 3-Clause). Run::

    python benchmarks/posteriordb/extract.py --repo /path/to/posteriordb   # a clone or a bare repository

The repository is read with ``git show <commit>:<path>`` (``--commit``, default ``HEAD``); the commit used
is written to ``SOURCE.json``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import arviz as az
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import POSTERIORS  # noqa: E402 (the registry sits beside this script)

DB = "posterior_database"
#: a data set's JSON longer than this is written gzipped (``diamonds``' 5,000 x 25 design: 2.3 MB, 0.3 MB)
GZIP_BYTES = 100_000


def git_show(repo: Path, commit: str, path: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True
    ).stdout


def unzip_json(raw: bytes):
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        (name,) = archive.namelist()
        return json.loads(archive.read(name))


def reference_summary(chains: list[dict]) -> dict:
    """Per parameter: mean, sd, bulk and tail ESS of the reference draws (a list of chains, each a dict
    of parameter name to draws)."""
    summary = {}
    for name in chains[0]:
        draws = np.array([chain[name] for chain in chains], dtype=np.float64)  # [chains, draws]
        summary[name] = {
            "mean": float(draws.mean()),
            "sd": float(draws.std(ddof=1)),
            "ess_bulk": float(az.ess(draws, method="bulk")),
            "ess_tail": float(az.ess(draws, method="tail")),
            "draws": int(draws.size),
        }
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--repo", type=Path, required=True, help="a clone (or bare repository) of posteriordb"
    )
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(args.repo), "rev-parse", args.commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    fields: dict[str, set[str]] = {}
    for posterior in POSTERIORS.values():
        fields.setdefault(posterior.data_name, set()).update(posterior.fields)
    (HERE / "data").mkdir(exist_ok=True)
    for data_name, used in fields.items():
        raw = unzip_json(git_show(args.repo, commit, f"{DB}/data/data/{data_name}.json.zip"))
        kept = {k: raw[k] for k in sorted(used)}
        text = (json.dumps(kept, separators=(",", ":")) + "\n").encode()
        if len(text) > GZIP_BYTES:  # mtime 0: the same bytes at every extraction
            (HERE / "data" / f"{data_name}.json.gz").write_bytes(gzip.compress(text, mtime=0))
        else:
            (HERE / "data" / f"{data_name}.json").write_bytes(text)
    (HERE / "reference").mkdir(exist_ok=True)
    (HERE / "stan").mkdir(exist_ok=True)
    for name, posterior in POSTERIORS.items():
        info = json.loads(git_show(args.repo, commit, f"{DB}/posteriors/{name}.json"))
        if (info["data_name"], info["model_name"]) != (posterior.data_name, posterior.stan_model):
            raise ValueError(f"{name}: posteriordb names {info['data_name']}, {info['model_name']}")
        chains = unzip_json(
            git_show(args.repo, commit, f"{DB}/reference_posteriors/draws/draws/{name}.json.zip")
        )
        reference = {"posterior": name, "chains": len(chains), "parameters": reference_summary(chains)}
        (HERE / "reference" / f"{name}.json").write_text(json.dumps(reference, indent=1) + "\n")
        stan = git_show(args.repo, commit, f"{DB}/models/stan/{posterior.stan_model}.stan")
        (HERE / "stan" / f"{posterior.stan_model}.stan").write_bytes(stan)
    (HERE / "LICENCE.md").write_bytes(git_show(args.repo, commit, "LICENCE.md"))
    source = {"repository": "https://github.com/stan-dev/posteriordb", "commit": commit}
    (HERE / "SOURCE.json").write_text(json.dumps(source, indent=1) + "\n")
    print(f"{len(POSTERIORS)} posteriors, {len(fields)} data sets from posteriordb {commit[:7]}")


if __name__ == "__main__":
    main()
