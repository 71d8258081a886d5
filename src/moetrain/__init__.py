"""moetrain: a PyTorch-native trainer for fine-grained mixture-of-experts models."""

__version__ = "0.1.0"
