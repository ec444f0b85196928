"""Factories of the digits demo job: model and data. Plain Keras; nothing orchestrator-specific."""
import numpy as np


def load_data(validation_fraction: float = 0.2):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype("float32") / 16.0)[..., None]  # (1797, 8, 8, 1)
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))  # a fixed split, not a training order
    x, y = x[order], y[order]
    n_val = int(len(x) * validation_fraction)
    return {"train": (x[n_val:], y[n_val:]), "validation": (x[:n_val], y[:n_val])}


def build_model():
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Flatten(),
        layers.Dropout(0.3),
        layers.Dense(64, activation="relu"),
        layers.Dense(10, activation="softmax"),
    ], name="digits_cnn")
