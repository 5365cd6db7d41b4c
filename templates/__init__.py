"""Jinja templates of epgen's kernels (package data; nothing to import)."""
