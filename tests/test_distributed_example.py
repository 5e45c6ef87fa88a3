"""The torchrun example, end to end: two processes started by ``torchrun`` give the draws of the same
script in one process (examples/distributed.py)."""

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# run under torchrun in place of the example: rank 1 of the group's first attempt is killed at its 8th chunk
KILLED_ONCE = """
import os, runpy, sys
import pyro_fed.kernels.chunks as chunks
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    original, calls = chunks.ChunkRunner.run_chunk, []
    def run_chunk(self):
        calls.append(None)
        if len(calls) == 8:
            open(os.path.join(marker, "killed"), "w").close()
            os._exit(1)
        return original(self)
    chunks.ChunkRunner.run_chunk = run_chunk
example, marker = sys.argv.pop(1), sys.argv.pop()
sys.argv[0] = example
runpy.run_path(example, run_name="__main__")
"""


def torchrun(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    command += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", *arguments]
    # bounded: a hung rank would be stopped by the group's timeout, the run by this one
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def one_process(out: Path) -> torch.Tensor:
    spec = importlib.util.spec_from_file_location("distributed_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        return example.main(["--smoke", "--out", str(out)])["w"]
    finally:
        torch.set_num_threads(threads)


def test_two_processes_under_torchrun_give_the_one_process_draws_also_restarted_after_a_kill(tmp_path):
    alone = one_process(tmp_path / "one")
    done = torchrun(str(EXAMPLE), "--smoke", "--out", str(tmp_path / "two"))
    assert "10 clients (5 per process)" in done.stdout
    two = torch.load(tmp_path / "two" / "draws.pt", weights_only=True)["w"]
    # the same sums over two blocks of clients, reassociated: float64 rounding, far below the draws' 0.05 sds
    torch.testing.assert_close(two, alone, rtol=1e-9, atol=1e-9)

    # a process killed in the middle of the run: torchrun restarts the group, which resumes from the
    # processes' checkpoints to the same draws as the uninterrupted run
    wrapper, out = tmp_path / "killed_once.py", tmp_path / "restarted"
    wrapper.write_text(KILLED_ONCE)
    out.mkdir()
    arguments = ["--smoke", "--checkpoint", str(tmp_path / "checkpoints"), "--out", str(out)]
    torchrun("--max-restarts=1", str(wrapper), str(EXAMPLE), *arguments, str(out))
    assert (out / "killed").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["fald-0.pt", "fald-1.pt"]
    restarted = torch.load(out / "draws.pt", weights_only=True)["w"]
    assert torch.equal(restarted, two)
