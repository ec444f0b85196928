"""What to do about a failure: the signature catalogue and classification, the recovery policy,
the actions, accelerator probes, the TensorFlow reinstall, fault injection. No TensorFlow.
"""
