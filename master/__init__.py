"""The coordinator: the training loop today; the worker pool, probing and dispatch build on it."""
