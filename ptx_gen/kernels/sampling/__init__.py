"""Sampling: the argmax over a vocabulary and the per-row sampler of a batch."""
