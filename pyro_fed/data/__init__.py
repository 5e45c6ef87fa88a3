"""Data and clients: which data points each client holds (:mod:`~pyro_fed.data.partition`), the data sets
shipped with the package (:mod:`~pyro_fed.data.datasets`) and each client's minibatches, drawn a chunk of
iterations at a time (:mod:`~pyro_fed.data.minibatch`)."""
