"""Training recipes: single-controller loops, readable top to bottom."""
