"""Triton kernels and their pure-torch references (imported as moetrain.kernels)."""
