"""Running iterations fast, whatever the algorithm: explicit randomness drawn a chunk ahead
(:mod:`~pyro_fed.engine.randomness`), tracing and compiling one iteration with a fallback
(:mod:`~pyro_fed.engine.compile`), replaying it over a chunk (:mod:`~pyro_fed.engine.chunk_engine`) and
storing the thinned draws (:mod:`~pyro_fed.engine.draws`). No Pyro import."""
