"""The supervisor process: the loop, the attempt, the run lock, hang handling, the console. Never
imports TensorFlow nor train/.
"""
