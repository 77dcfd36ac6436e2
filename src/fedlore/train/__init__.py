"""The one local-training loop (with hooks) and evaluation."""
