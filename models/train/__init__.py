"""The training stage's ranks: the draft trained on captured hidden states (`python -m models.train`)."""
