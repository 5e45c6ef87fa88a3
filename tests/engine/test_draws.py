import numpy as np
import torch

from pyro_fed.engine.draws import DrawBuffer


def chunk(start, num_iterations=4, num_chains=2):
    k = torch.arange(start, start + num_iterations, dtype=torch.float64)
    positions = k[:, None, None].expand(num_iterations, num_chains, 3)
    finite = torch.ones(num_iterations, num_chains, dtype=torch.bool)
    finite[1, 0] = False  # chain 0 reverted its second iteration
    coins = {"communicated": np.zeros((num_iterations, num_chains), dtype=bool)}
    coins["communicated"][2, 1] = True
    counts = np.arange(start + 1, start + num_iterations + 1)[:, None].repeat(num_chains, 1)
    statistics = {"dispersion": k[:, None].expand(num_iterations, num_chains)}
    return positions, finite, statistics, coins, (10 * counts, 20 * counts, counts)


def test_thinning_windows_and_cumulative_counts():
    buffer = DrawBuffer(thinning=2, keep=True)
    buffer.add(*chunk(0))
    buffer.add(*chunk(4))
    # draw j is iteration 2 j + 1; flags cover iterations 2 j and 2 j + 1
    assert [buffer.draw(j, 1)[0].item() for j in range(4)] == [1.0, 3.0, 5.0, 7.0]
    stats = buffer.sample_stats(chain=0, start=0, stop=4)
    assert stats["diverging"].tolist() == [True, False, True, False]
    assert buffer.sample_stats(chain=1, start=0, stop=4)["communicated"].tolist() == [
        False,
        True,
        False,
        True,
    ]
    assert stats["dispersion"].tolist() == [1.0, 3.0, 5.0, 7.0]
    assert buffer.bits("uploaded", 2, chain=1) == 60 and buffer.rounds_at(2, chain=1) == 6
    assert buffer.bits("downloaded", 2, chain=1) == 120 and buffer.bits("uploaded", -1, chain=0) == 0
    assert [buffer.divergences_at(j, chain=0) for j in range(4)] == [1, 1, 2, 2]
    assert buffer.sample_stats(chain=0, start=1, stop=3)["uploaded_bits"].tolist() == [40, 60]


def test_served_chunks_are_dropped_unless_kept():
    buffer = DrawBuffer(thinning=1, keep=False)
    buffer.add(*chunk(0))
    buffer.add(*chunk(4))
    assert buffer.positions[0] is None and buffer.draw(5, 0)[0].item() == 5.0
