"""Renderers: each reads a Report and nothing else (no torch internals, no live objects)."""
