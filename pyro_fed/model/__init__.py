"""The user's Pyro model, split into clients: its sites, the unconstrained space, batched per-client
gradients, the federated potential and per-draw predictive evaluations. The only layer but the kernels that
runs Pyro."""
