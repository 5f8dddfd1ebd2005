"""Desired children of an InferenceService as plain dicts, one module per child kind."""
