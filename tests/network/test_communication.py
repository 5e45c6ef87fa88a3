import numpy as np
import torch

from pyro_fed.algorithms import traffic
from pyro_fed.algorithms.dispersion import dispersion, held_moments, mean_and_dispersion
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
    torch.testing.assert_close(dispersion(uploads, network), spread)


class TwoHolders(InProcessNetwork):
    """Clients 0-2 and 3-6 held in two places: ``stacked`` returns both holders' parts, given ahead."""

    parts: torch.Tensor

    def stacked(self, part):
        return self.parts

    def holdings(self, num_clients):
        return [slice(0, 3), slice(3, num_clients)]


def test_the_holders_moments_combine_into_every_clients_mean_and_dispersion():
    clients = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    network = TwoHolders(num_clients=7, dim=3, num_chains=2)
    network.parts = torch.stack([held_moments(clients[:, :3]), held_moments(clients[:, 3:])])
    mean, spread = mean_and_dispersion(network.parts[0], network)
    torch.testing.assert_close(mean, clients.mean(1), rtol=1e-14, atol=1e-14)
    expected = (clients - clients.mean(1, keepdim=True)).square().sum(-1).mean(-1)
    torch.testing.assert_close(spread, expected, rtol=1e-14, atol=1e-14)
    # one holder: its own moments, to the bit
    one = InProcessNetwork(num_clients=7, dim=3, num_chains=2)
    mean, spread = mean_and_dispersion(held_moments(clients), one)
    assert torch.equal(mean, clients.mean(1)) and torch.equal(spread, held_moments(clients)[..., -1])


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
