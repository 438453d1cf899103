"""Helpers shared by the tests: fake conformance hooks and workers, and checks that run in a
process of their own."""
