"""Public test utilities: the mode conformance suite and tiny random models."""
