"""Pure tensor implementations of the federated Langevin algorithms (no Pyro import).

Each algorithm is a small module with ``init(...) -> State``, ``step(state, ...) -> (State, Info)`` and
``position(state)`` (the global iterate reported as a draw), in the style of BlackJAX. States and infos are
NamedTuples of tensors; randomness is explicit (:class:`~pyro_fed.algorithms.rng.Randomness`) and
everything that crosses the network goes through a communication object
(:mod:`pyro_fed.communication`).
"""
