"""Turning logits into tokens: greedy and seeded sampling with the usual transforms."""
