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


def test_two_processes_under_torchrun_give_the_one_process_draws(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    command += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    command += [str(EXAMPLE), "--smoke", "--out", str(tmp_path / "two")]
    # bounded: a hung rank would be stopped by the group's timeout, the run by this one
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "10 clients (5 per process)" in done.stdout

    spec = importlib.util.spec_from_file_location("distributed_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        alone = example.main(["--smoke", "--out", str(tmp_path / "one")])["w"]
    finally:
        torch.set_num_threads(threads)
    two = torch.load(tmp_path / "two" / "draws.pt", weights_only=True)["w"]
    # the same sums over two blocks of clients, reassociated: float64 rounding, far below the draws' 0.05 sds
    torch.testing.assert_close(two, alone, rtol=1e-9, atol=1e-9)
