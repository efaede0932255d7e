"""The target model: loading its weights and config, and the deterministic tiny targets for tests and the demo."""
