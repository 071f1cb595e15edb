"""The algorithms, one module each; :mod:`.registry` maps names to them."""
