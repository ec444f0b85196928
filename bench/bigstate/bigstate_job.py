"""The bench's big-state jobs (issue 37): an MLP of ~100 M parameters on synthetic vectors,
trained whole with Adam (a state of ~1.2 GB: weights and two slots), or with all but its head
frozen (the same weights, ~0.4 GB, and an optimizer state the size of the head's)."""
import numpy as np


def load_data(examples: int = 640, features: int = 1024, classes: int = 10):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, features), dtype=np.float32)
    y = rng.integers(0, classes, examples).astype("int32")
    return {"train": (x, y)}


def build_model(features: int = 1024, width: int = 4096, hidden: int = 6, classes: int = 10,
                frozen: bool = False):
    """``hidden`` Dense layers of ``width`` (the backbone) and a Dense head; ``frozen``: the
    backbone's ``trainable`` is False, as a fine-tune of a pretrained one would set it."""
    import keras

    backbone = keras.Sequential(
        [keras.Input((features,))]
        + [keras.layers.Dense(width, activation="relu", name=f"dense_{i}") for i in range(hidden)],
        name="backbone")
    backbone.trainable = not frozen
    inputs = keras.Input((features,))
    outputs = keras.layers.Dense(classes, activation="softmax", name="head")(backbone(inputs))
    return keras.Model(inputs, outputs, name="bigstate_mlp")
