"""The pictures a run records of itself, drawn as SVG with the standard library."""
