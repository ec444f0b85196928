"""Checkpoints: the atomic store, the two tiers (local, durable), retention, the durable mirror. No
TensorFlow.
"""
