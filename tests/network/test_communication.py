import numpy as np
import torch

from pyro_fed.algorithms import traffic
from pyro_fed.network.in_process import InProcessNetwork


def test_average_broadcast_and_select():
    network = InProcessNetwork(num_clients=4, dim=3, num_chains=2)
    uploads = torch.arange(24.0).reshape(2, 4, 3)
    mean = network.average(uploads)
    torch.testing.assert_close(mean, uploads.mean(1))
    copies = network.broadcast(mean, 4)
    assert copies.shape == (2, 4, 3) and torch.equal(copies[1, 2], mean[1])
    selected = network.average_where(torch.tensor([True, False]), uploads)
    torch.testing.assert_close(selected[0], mean[0].expand(4, 3))
    torch.testing.assert_close(selected[1], uploads[1])
    spread = (uploads - mean[:, None]).square().sum(-1).mean(-1)
    torch.testing.assert_close(network.dispersion(uploads), spread)


def test_bits_counted_from_host_coins():
    network = InProcessNetwork(num_clients=4, dim=3, num_chains=2)
    averaged = np.array([[1, 0], [0, 0], [3, 1]])  # averages per iteration (rows) and chain (columns)
    rounds = np.array([[True, False], [False, False], [True, True]])
    bits, downloaded, cumulative_rounds = network.record(*traffic.averages(averaged, 4, 3), rounds)
    per_average = 4 * 3 * 32  # 4 clients upload d = 3 floats of 32 bits, and download the average
    assert bits.tolist() == [[per_average, 0], [per_average, 0], [4 * per_average, per_average]]
    assert downloaded.tolist() == bits.tolist()
    assert cumulative_rounds.tolist() == [[1, 0], [1, 0], [2, 1]]
    assert network.uploaded_bits.tolist() == [4 * per_average, per_average]
    assert network.downloaded_bits.tolist() == [4 * per_average, per_average]
    bits, _, _ = network.record(*traffic.averages(averaged[:1], 4, 3), rounds[:1])  # cumulative across chunks
    assert bits.tolist() == [[5 * per_average, per_average]]
    # any per-iteration traffic (e.g. quantised messages of fractional cost): rounded to whole bits
    bits, downloaded, _ = network.record(np.array([[10.4, 0.6]]), np.array([[1, 2]]), np.zeros((1, 2), bool))
    assert bits.tolist() == [[5 * per_average + 10, per_average + 1]]


def test_a_servers_traffic():
    active = np.array([[2, 0], [4, 1]])  # active clients per iteration (rows) and chain (columns)
    snapshot = np.array([[0, 1], [0, 0]])
    uploaded, downloaded, rounds = traffic.server(active, 50.0, 4, 3, snapshot)
    assert uploaded.tolist() == [[100.0, 0.0], [200.0, 50.0]]  # each active client's message
    # each active client downloads theta (3 floats); a snapshot sends theta to all 4
    assert downloaded.tolist() == [[2 * 96, 4 * 96], [4 * 96, 96]]
    assert rounds.tolist() == [[True, False], [True, True]]
