import torch

from pyro_fed.communication import InProcessNetwork


def test_average_and_broadcast_count_bits():
    network = InProcessNetwork(num_clients=4)
    uploads = torch.arange(12.0).reshape(4, 3)
    mean = network.average(uploads)
    torch.testing.assert_close(mean, uploads.mean(0))
    copies = network.broadcast(mean)
    assert copies.shape == (4, 3) and torch.equal(copies[2], mean)
    assert network.uploaded_bits == 4 * 3 * 32
    assert network.broadcast_bits == 3 * 32
    assert network.rounds == 1
