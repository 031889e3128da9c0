"""Helpers shared by the tests: references, checkpoint makers, plugins."""
