"""The capture stage's ranks: the target's aux hidden states written as shards (`python -m models.capture`)."""
