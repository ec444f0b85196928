"""Failure kinds and what to do about them: the signature catalogue, classification, the recovery policy, the actions, accelerator probes, the TensorFlow reinstall, fault injection. No TensorFlow."""
