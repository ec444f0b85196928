"""The Colab simulator's ``google.colab`` (tests/fakes/colab_sim.py puts this folder on its
runtimes' ``PYTHONPATH``, never elsewhere): ``drive`` only. ``google`` stays a namespace
package (no ``__init__.py`` there), so ``google.protobuf`` still imports beside it."""
