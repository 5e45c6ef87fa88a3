"""Pure tensor implementations of the federated Langevin algorithms (no Pyro import).

Each algorithm is a small module in the style of BlackJAX: its state (a NamedTuple of tensors with a leading
chain dimension, independent chains simulated together), ``init(positions, ...)``, ``step(state,
gradients, ..., network)`` and ``position(state, network)`` (the global iterate reported as a draw), and one
class that keeps the contract every algorithm shares (:class:`~pyro_fed.algorithms.base.Algorithm`: its
coins and inputs per chunk, its traffic and its events, its warm-up traits, and its settings bound to each
run). Randomness is explicit: the noise and the coins
are inputs of ``step``, drawn ahead for a chunk of iterations, so that one iteration is a fixed sequence of
tensor operations that can be traced, compiled and replayed (:mod:`pyro_fed.engine.chunk_engine`).
Everything that crosses the network goes through a :class:`~pyro_fed.network.base.Network`; the bits each
iteration sent are counted on the host from its coins.
"""
