"""Serving-time logging: the records of what the steps served (docs/design/loop.md)."""
