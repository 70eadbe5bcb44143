"""Forgeboard's training engine. Django-free: runs on GPU nodes, standalone from its CLI."""
