"""The outer loop: ``orchestrator colab``, run on a machine that stays up, gets Colab runtimes
through Google's Colab CLI (the ``colab`` executable), starts ``orchestrator run`` in each and
gets another when one is lost. Never imports TensorFlow, JAX nor train/, and never reads the
CLI's credentials: everything goes through the executable.
"""
