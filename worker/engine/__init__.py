"""The classification engine: tokenize -> bucket -> one forward pass -> label scores."""
