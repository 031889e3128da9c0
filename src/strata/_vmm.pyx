"""Placeholder: replaced by the real module."""
