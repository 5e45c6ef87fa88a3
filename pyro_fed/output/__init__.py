"""What a run gives the user: ArviZ ``InferenceData`` (:mod:`~pyro_fed.output.arviz`) and the papers'
metrics (:mod:`~pyro_fed.output.metrics`)."""
