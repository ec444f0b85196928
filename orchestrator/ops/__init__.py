"""The operator's commands: status, timeline, report, doctor, diagnose. No TensorFlow."""
