"""Policies: the plugin API and the built-in policies."""
