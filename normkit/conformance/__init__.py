"""Conformance: every implementation of a norm checked against `normkit.reference`."""
