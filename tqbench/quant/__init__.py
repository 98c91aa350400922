"""Quantization formats, in plain numpy."""
