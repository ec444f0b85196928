"""Shared by both processes: the job spec, the run directory's layout, the journal, the heartbeat,
os helpers. No TensorFlow.
"""
