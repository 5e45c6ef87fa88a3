"""Where clients meet: the in-process network that averages their uploads and counts the bits
(:mod:`~pyro_fed.network.in_process`), the compression of uploads (:mod:`~pyro_fed.network.compression`)
and the graphs of decentralized clients (:mod:`~pyro_fed.network.graphs`)."""
