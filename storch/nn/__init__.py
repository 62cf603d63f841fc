"""Plate-aware losses (``storch.nn``)."""

from storch.nn.losses import b_binary_cross_entropy

__all__ = ["b_binary_cross_entropy"]
