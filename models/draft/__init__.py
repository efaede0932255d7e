"""The EAGLE-3 draft model: its config, layers, caches, draft vocab and the target's head it trains against."""
