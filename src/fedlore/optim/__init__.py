"""Projected optimizers and subspace construction (FedLore, GaLore)."""
