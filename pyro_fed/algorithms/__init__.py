"""Pure tensor implementations of the federated Langevin algorithms (no Pyro import).

Each algorithm is a small module with ``init(positions, ...) -> State``, ``step(state, gradients, noise,
coins, network, ...) -> State`` and ``position(state, network)`` (the global iterate reported as a draw), in
the style of BlackJAX. States are NamedTuples of tensors with a leading chain dimension (independent chains
simulated together). Randomness is explicit: the noise and the coins are inputs of ``step``, drawn ahead
for a chunk of iterations, so that one iteration is a fixed sequence of tensor operations that can be
traced, compiled and replayed (:mod:`pyro_fed.engine.chunk_engine`). Everything that crosses the network goes
through a communication object (:mod:`pyro_fed.network.in_process`); ``averages(coins)`` tells it, on the
host, what each iteration sent.
"""
