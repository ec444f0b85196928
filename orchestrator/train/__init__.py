"""The worker process: the only package that imports TensorFlow and Keras."""
