"""Checkpoints: a run interrupted after some chunks and resumed from its checkpoint gives the uninterrupted
run's draws, statistics and bits bit for bit, without a second warm-up; a checkpoint of another
configuration is refused, naming what differs; the file holds tensors only."""

import contextlib
import inspect
import os
import re

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import DulaKernel, FaldKernel, QlsdKernel, VrFaldKernel
from pyro_fed.algorithms import adaptation
from pyro_fed.engine.draws import DrawBuffer
from pyro_fed.engine.randomness import Randomness
from pyro_fed.kernels import checkpoint, warmup
from pyro_fed.kernels.chunks import ChunkRunner

from ..engine.test_draws import chunk
from ..models import logistic_model, regression_data

# short runs: the chains have not mixed
pytestmark = pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")
NUM_SAMPLES, WARMUP = 30, 10  # 40 draws per chain: 5 chunks of 8 iterations
OPTIONS = {"gradient_mode": "traced", "chunk_size": 8}
KERNELS = {
    "FALD": lambda **kw: FaldKernel(
        logistic_model, 4, comm_prob=0.5, noise_corr=0.5, batch_size=4, step_size=0.01, **OPTIONS, **kw
    ),
    "VR-FALD*": lambda **kw: VrFaldKernel(
        logistic_model, 4, comm_prob=0.5, batch_size=4, refresh_prob=0.2, step_size=0.01, **OPTIONS, **kw
    ),
    "QLSD++": lambda **kw: QlsdKernel(
        logistic_model,
        4,
        control_variate="svrg",
        batch_size=4,
        snapshot_every=5,
        step_size=0.002,
        **OPTIONS,
        **kw,
    ),
    "D-ULA": lambda **kw: DulaKernel(logistic_model, 4, step_size=0.002, **OPTIONS, **kw),
}


def data():
    x, y = regression_data(num_data=40, dim=3)
    return x, (y > 0).double()


@contextlib.contextmanager
def interrupted_at(call):
    """``ChunkRunner.run_chunk`` raises ``KeyboardInterrupt`` at its ``call``-th call (never with ``None``);
    yields the list of calls made."""
    original, calls = ChunkRunner.run_chunk, []

    def run_chunk(self):
        calls.append(self.computed)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(self)

    ChunkRunner.run_chunk = run_chunk
    try:
        yield calls
    finally:
        ChunkRunner.run_chunk = original


def run(kernel, args=None, num_chains=2, num_samples=NUM_SAMPLES, interrupt=None, seed=0, warmup=WARMUP):
    """The run of ``kernel`` (global seed ``seed``), and the iterations at which it ran its chunks."""
    mcmc = MCMC(
        kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=num_chains, disable_progbar=True
    )
    pyro.set_rng_seed(seed)
    with interrupted_at(interrupt) as calls:
        mcmc.run(*(args or data()))
    return mcmc, calls


def interrupt(kernel, call=3, **kwargs):
    with pytest.raises(KeyboardInterrupt):
        run(kernel, interrupt=call, **kwargs)


def results(mcmc):
    """The draws, per-draw statistics and bits of every chain."""
    diagnostics = mcmc.diagnostics()
    keys = ("uploaded bits", "downloaded bits", "communication rounds")
    return (
        mcmc.get_samples(group_by_chain=True),
        {f"chain {chain}": mcmc.kernel.sample_stats(chain) for chain in range(mcmc.num_chains)},
        {key: diagnostics[key] for key in keys},
    )


def assert_bitwise_equal(first, second):
    (draws_a, stats_a, bits_a), (draws_b, stats_b, bits_b) = first, second
    assert draws_a.keys() == draws_b.keys()
    for name in draws_a:
        assert torch.equal(draws_a[name], draws_b[name]), name
    assert stats_a.keys() == stats_b.keys()
    for chain in stats_a:
        assert list(stats_a[chain]) == list(stats_b[chain]), chain
        for name, values in stats_a[chain].items():
            other = stats_b[chain][name]
            assert values.dtype == other.dtype and np.array_equal(values, other), (chain, name)
    assert bits_a == bits_b


@pytest.mark.parametrize(("name", "num_chains"), [*((name, 2) for name in KERNELS), ("FALD", 1)])
def test_an_interrupted_run_resumes_to_the_uninterrupted_draws_bitwise(tmp_path, name, num_chains):
    path = tmp_path / "run.pt"
    expected = results(run(KERNELS[name](), num_chains=num_chains)[0])
    # checkpoints after 8 and 16 draws per chain; the third chunk is interrupted
    interrupt(KERNELS[name](checkpoint=path, checkpoint_every=5), num_chains=num_chains)
    assert checkpoint.load(str(path))["meta"]["computed"] == 16
    mcmc, calls = run(KERNELS[name](checkpoint=path, checkpoint_every=5), num_chains=num_chains)
    assert calls == [16, 24, 32]  # only the chunks that were not checkpointed are computed
    assert_bitwise_equal(results(mcmc), expected)
    assert checkpoint.load(str(path))["meta"]["computed"] == 40  # the finished run's checkpoint


def test_a_resumed_run_draws_from_the_checkpointed_seeds_whatever_the_global_seed(tmp_path):
    path = tmp_path / "run.pt"
    expected = results(run(KERNELS["FALD"]())[0])
    interrupt(KERNELS["FALD"](checkpoint=path, checkpoint_every=5))
    kernel = KERNELS["FALD"](checkpoint=path, checkpoint_every=5)
    mcmc, _ = run(kernel, seed=1)  # the restarted script seeds the global RNG otherwise
    assert_bitwise_equal(results(mcmc), expected)
    # a stream first drawn from after the resume (a client block's) comes from the run's seed
    assert kernel.rng.seed == checkpoint.load(str(path))["meta"]["seeds"][0]


AUTOMATIC = {
    "FALD": lambda **kw: FaldKernel(logistic_model, 4, comm_prob=0.5, **kw),
    # the levels the warm-up chose, restored with it: the resumed run compresses as the first did
    "QLSD++ automatic levels": lambda **kw: QlsdKernel(
        logistic_model, 4, control_variate="svrg", quantization_levels="auto", **kw
    ),
}


@pytest.mark.parametrize("name", AUTOMATIC)
def test_the_automatic_warm_up_is_restored_not_run_again(tmp_path, monkeypatch, name):
    path = tmp_path / "automatic.pt"

    def kernel(**kw):
        return AUTOMATIC[name](gradient_mode="traced", chunk_size=8, **kw)

    first, _ = run(kernel(), num_samples=10)
    expected = results(first)
    chosen = first.kernel.adaptation
    assert chosen is not None and chosen.rounds > 0  # the warm-up's rounds are counted in the bits
    interrupt(kernel(checkpoint=path, checkpoint_every=1), call=3, num_samples=10)
    assert checkpoint.load(str(path))["meta"]["computed"] == 2 * first.kernel.runner.chunk

    def no_second_warm_up(*args, **kwargs):
        raise AssertionError("the warm-up ran again")

    monkeypatch.setattr(warmup, "adapt", no_second_warm_up)
    mcmc, _ = run(kernel(checkpoint=path, checkpoint_every=1), num_samples=10)
    assert_bitwise_equal(results(mcmc), expected)  # the warm-up's bits included
    restored = mcmc.kernel.adaptation
    for field, value in chosen._asdict().items():
        other = getattr(restored, field)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), field
        else:
            assert type(value) is type(other) and (value == other or value != value and other != other), field


@pytest.mark.parametrize("name", AUTOMATIC)
def test_a_run_resumed_between_the_warm_up_windows_meets_the_second_as_the_first_run_did(
    tmp_path, monkeypatch, name
):
    # the warm-up measures the preconditioner again from the chains' draws after each of its two windows (of
    # a warm-up of 120 draws: after 60 and 90); a run resumed between them holds the first window's
    # preconditioner and meets the second from the restored draws, as the uninterrupted run did. Every
    # window replaces the preconditioner here (no spread is within chance): the test is of the resumption
    monkeypatch.setattr(adaptation, "DENSE_CONDITION", 0.0)
    measured = []
    original = adaptation.draws_preconditioner

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        measured.append(result is not None)
        return result

    monkeypatch.setattr(adaptation, "draws_preconditioner", counted)
    path = tmp_path / "windows.pt"

    def kernel(**kw):
        return AUTOMATIC[name](gradient_mode="traced", chunk_size=8, **kw)

    first, _ = run(kernel(), num_samples=20, warmup=120)
    assert measured == [True, True]
    thinning = first.kernel.current_thinning
    chunk = max(1, 8 // thinning) * thinning  # a chunk holds whole draws of chunk_size iterations at most
    # a chunk after the first window's 60 draws, before the second's 90
    interrupt(
        kernel(checkpoint=path, checkpoint_every=1), call=75 * thinning // chunk, num_samples=20, warmup=120
    )
    assert 60 * thinning <= checkpoint.load(str(path))["meta"]["computed"] < 90 * thinning
    measured.clear()
    resumed, _ = run(kernel(checkpoint=path, checkpoint_every=1), num_samples=20, warmup=120)
    assert measured == [True]  # the second window only: the first one's preconditioner was restored
    assert_bitwise_equal(results(resumed), results(first))


def test_a_checkpoint_of_another_configuration_is_refused_naming_what_differs(tmp_path):
    path = tmp_path / "run.pt"
    interrupt(KERNELS["FALD"](checkpoint=path))
    other = FaldKernel(
        logistic_model,
        4,
        comm_prob=0.2,
        noise_corr=0.5,
        batch_size=4,
        step_size=0.01,
        checkpoint=path,
        **OPTIONS,
    )
    with pytest.raises(ValueError, match=r"with comm_prob=0\.5; this one has comm_prob=0\.2\. .*delete it"):
        run(other)
    with pytest.raises(ValueError, match="with num_samples=30; this one has num_samples=31"):
        run(KERNELS["FALD"](checkpoint=path), num_samples=31)
    with pytest.raises(ValueError, match="num_chains=2; this one has num_chains=1"):
        run(KERNELS["FALD"](checkpoint=path), num_chains=1)
    x, y = data()
    with pytest.raises(ValueError, match="model argument 0"):  # other data, of the same shape
        run(KERNELS["FALD"](checkpoint=path), args=(x + 1.0, y))
    with pytest.raises(ValueError, match="kernel="):
        run(KERNELS["VR-FALD*"](checkpoint=path))
    assert checkpoint.load(str(path))["meta"]["computed"] == 16  # refused, not overwritten


def test_the_checkpoint_holds_tensors_only_and_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "run.pt"
    written, save = [], checkpoint.save

    def counted(where, tensors):
        written.append(checkpoint.decode(tensors["meta"])["computed"])
        save(where, tensors)

    monkeypatch.setattr(checkpoint, "save", counted)
    mcmc, _ = run(KERNELS["QLSD++"](checkpoint=path, checkpoint_every=10))
    # after the chunks that complete 10 more draws per chain, and the last
    assert written == [16, 32, 40]
    # the last two checkpoints, and no temporary file left behind
    assert sorted(os.listdir(tmp_path)) == ["run.pt", "run.pt.previous"]
    assert checkpoint.load(f"{path}.previous")["meta"]["computed"] == 32
    contents = torch.load(path, weights_only=True)
    assert all(isinstance(value, torch.Tensor) for value in contents.values())
    meta = checkpoint.decode(contents["meta"])
    assert meta["fingerprint"]["snapshot_every"] == 5 and meta["fingerprint"]["num_chains"] == 2
    assert contents["buffer.history"].shape == (40, 2, 3)
    assert torch.equal(contents["buffer.history"], mcmc.kernel.runner.buffer.state()["history"])
    assert contents["rng.tensors"].dtype == torch.uint8 and len(meta["seeds"]) == 2


def test_checkpoints_change_no_draw_and_a_finished_run_is_served_from_its_own(tmp_path):
    path = tmp_path / "run.pt"
    expected = results(run(KERNELS["VR-FALD*"]())[0])
    first, calls = run(KERNELS["VR-FALD*"](checkpoint=path, checkpoint_every=1))  # a write after every chunk
    assert len(calls) == 5
    assert_bitwise_equal(results(first), expected)
    again, calls = run(KERNELS["VR-FALD*"](checkpoint=path, checkpoint_every=1))
    assert calls == []  # nothing left to compute
    assert_bitwise_equal(results(again), expected)


def test_checkpoint_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every=5 without a checkpoint"):
        KERNELS["FALD"](checkpoint_every=5)
    with pytest.raises(ValueError, match="is a directory"):
        KERNELS["FALD"](checkpoint=tmp_path)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive integer"):
        KERNELS["FALD"](checkpoint=tmp_path / "run.pt", checkpoint_every=0)
    kernel = KERNELS["D-ULA"](checkpoint=tmp_path / "run.pt")
    assert kernel.checkpoint == str(tmp_path / "run.pt") and kernel.checkpoint_every is None
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="could not be read"):
        run(KERNELS["D-ULA"](checkpoint=tmp_path / "junk.pt"))


def test_a_buffer_refilled_from_its_state_serves_and_reports_the_same():
    buffer = DrawBuffer(thinning=2, keep=False)
    for start in (0, 4, 8):
        buffer.add(*chunk(start))
    refilled = DrawBuffer(thinning=2, keep=False)
    refilled.load_state(buffer.state(), torch.float32, torch.device("cpu"))
    # the dropped draws are read back from the float64 history, in the draws' own dtype
    assert [refilled.draw(j, 1)[0].item() for j in range(6)] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert refilled.draw(0, 0).dtype == torch.float32
    for name, values in buffer.sample_stats(0, 1, 6).items():
        assert np.array_equal(refilled.sample_stats(0, 1, 6)[name], values), name
    assert refilled.bits("uploaded", 4, 1) == buffer.bits("uploaded", 4, 1)
    assert refilled.divergences_at(5, 0) == buffer.divergences_at(5, 0) == 3
    refilled.add(*chunk(12))  # and goes on as the original would
    buffer.add(*chunk(12))
    assert refilled.rounds_at(7, 0) == buffer.rounds_at(7, 0)


def test_restored_generators_draw_what_would_have_followed():
    rng = Randomness(7)
    rng.normal(5, dtype=torch.float64)
    rng.coins(0.5, 5)
    state = rng.state()
    expected = rng.normal(5, dtype=torch.float64), rng.coins(0.5, 100)
    restored = Randomness(123)
    restored.set_state(state)
    assert torch.equal(restored.normal(5, dtype=torch.float64), expected[0])
    assert np.array_equal(restored.coins(0.5, 100), expected[1])


def test_the_kernels_keep_their_signatures():
    # the constructor arguments kept for the fingerprint leave every kernel's signature as written
    assert {"comm_prob", "checkpoint", "checkpoint_every"} <= set(inspect.signature(FaldKernel).parameters)
    assert "control_variate" in inspect.signature(QlsdKernel).parameters


def flip_a_bit_of_a_draw(path, draw):
    """Flip the lowest bit of draw ``draw`` (chain 0's first coordinate, a float64) where the file stores
    it; returns the file's bytes as they were."""
    history = torch.load(path, weights_only=True)["buffer.history"]
    untouched = path.read_bytes()
    stored = history[draw].numpy().tobytes()
    assert untouched.count(stored) == 1  # the draw's bytes are found once: those of the stored draw
    damaged = bytearray(untouched)
    damaged[untouched.index(stored)] ^= 1
    path.write_bytes(bytes(damaged))
    altered = torch.load(path, weights_only=True)["buffer.history"]  # torch reads it in silence
    assert not torch.equal(altered, history) and torch.equal(altered[draw + 1 :], history[draw + 1 :])
    return untouched


def test_a_damaged_checkpoint_is_refused_and_an_untouched_one_resumes_bitwise(tmp_path):
    path = tmp_path / "run.pt"
    expected = results(run(KERNELS["FALD"]())[0])
    interrupt(KERNELS["FALD"](checkpoint=path, checkpoint_every=5))
    untouched = flip_a_bit_of_a_draw(path, 10)
    with pytest.raises(
        ValueError,
        match=rf"the checkpoint at {re.escape(str(path))} is damaged: .* Delete it to start afresh",
    ):
        run(KERNELS["FALD"](checkpoint=path, checkpoint_every=5))
    path.write_bytes(untouched)
    mcmc, calls = run(KERNELS["FALD"](checkpoint=path, checkpoint_every=5))
    assert calls == [16, 24, 32]
    assert_bitwise_equal(results(mcmc), expected)
    # a finished run's checkpoint, damaged, is not served either
    flip_a_bit_of_a_draw(path, 35)
    with pytest.raises(ValueError, match=rf"the checkpoint at {re.escape(str(path))} is damaged"):
        run(KERNELS["FALD"](checkpoint=path, checkpoint_every=5))


def test_a_checkpoint_of_the_format_before_or_without_its_checksum_is_refused(tmp_path):
    path = tmp_path / "run.pt"
    run(KERNELS["D-ULA"](checkpoint=path), num_samples=6)
    contents = torch.load(path, weights_only=True)
    assert torch.equal(contents["checksum"], checkpoint.checksum(contents))
    del contents["checksum"]
    torch.save(contents, tmp_path / "no_checksum.pt")
    with pytest.raises(ValueError, match="no_checksum.pt is damaged"):
        checkpoint.load(str(tmp_path / "no_checksum.pt"))
    meta = checkpoint.decode(contents["meta"])
    contents["meta"] = checkpoint.encode({**meta, "format": 3})  # as pyro_fed wrote before the checksum
    torch.save(contents, tmp_path / "old.pt")
    with pytest.raises(ValueError, match=r"old.pt has format 3; this pyro_fed reads format 4: delete it"):
        checkpoint.load(str(tmp_path / "old.pt"))


def test_a_checkpoint_path_that_cannot_be_written_is_refused_at_construction(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a file, not a folder")
    for under_a_file in (notes / "run.pt", notes / "runs" / "run.pt"):
        with pytest.raises(
            ValueError, match=rf"lies under '{re.escape(str(notes))}', which is a file, not a folder: .* Give"
        ):
            KERNELS["FALD"](checkpoint=under_a_file)
    with pytest.raises(ValueError, match=r"checkpoint must be a file path .*; got ''"):
        KERNELS["FALD"](checkpoint="")


def test_a_checkpoint_in_a_folder_still_to_make_is_written_there(tmp_path):
    path = tmp_path / "runs" / "today" / "run.pt"  # the first write makes the folders
    run(KERNELS["D-ULA"](checkpoint=path), num_samples=6)
    assert checkpoint.load(str(path))["meta"]["computed"] == 16


def test_a_checkpoint_in_a_folder_not_writable_is_refused_at_construction(tmp_path, monkeypatch):
    # os.access is what decides (the kernel's answer, read-only file systems included); here it says no
    folder = tmp_path / "shared"
    folder.mkdir()
    monkeypatch.setattr(os, "access", lambda where, mode: os.fspath(where) != str(folder))
    with pytest.raises(
        ValueError, match=rf"its folder '{re.escape(str(folder))}' is not writable by this process .* Give a"
    ):
        KERNELS["FALD"](checkpoint=folder / "run.pt")
    new = re.escape(str(folder / "new"))
    with pytest.raises(
        ValueError, match=rf"'{re.escape(str(folder))}', where its folder '{new}' would be made"
    ):
        KERNELS["FALD"](checkpoint=folder / "new" / "run.pt")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder: there is no late error")
def test_a_checkpoint_in_a_read_only_folder_is_refused_at_construction(tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="is not writable by this process"):
            KERNELS["FALD"](checkpoint=folder / "run.pt")
    finally:
        folder.chmod(0o755)
