"""Dashboard pages, one module per area. Thin: read through selectors, write through services."""
