"""ResNet v1 for CIFAR-10 (He et al. 2015, as in the Keras example), and its data."""
import numpy as np


def load_data(synthetic: bool = False, synthetic_examples: int = 512):
    if synthetic:
        rng = np.random.default_rng(0)
        x = rng.random((synthetic_examples, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, synthetic_examples).astype("int32")
        n_val = synthetic_examples // 8
        return {"train": (x[n_val:], y[n_val:]), "validation": (x[:n_val], y[:n_val])}
    import keras

    (x, y), (xv, yv) = keras.datasets.cifar10.load_data()
    mean = x.astype("float32").mean(axis=0) / 255.0
    prep = lambda a: a.astype("float32") / 255.0 - mean  # noqa: E731
    return {"train": (prep(x), y.astype("int32").ravel()),
            "validation": (prep(xv), yv.astype("int32").ravel())}


def build_model(depth: int = 20, num_classes: int = 10):
    import keras
    from keras import layers

    if (depth - 2) % 6:
        raise ValueError(f"ResNet v1 depth must be 6n+2 (20, 32, 44, 56, 110), got {depth}")
    blocks = (depth - 2) // 6

    def conv_bn(x, filters, strides=1, activation=True):
        x = layers.Conv2D(filters, 3, strides=strides, padding="same",
                          kernel_initializer="he_normal",
                          kernel_regularizer=keras.regularizers.l2(1e-4))(x)
        x = layers.BatchNormalization()(x)
        return layers.Activation("relu")(x) if activation else x

    inputs = keras.Input((32, 32, 3))
    x = conv_bn(inputs, 16)
    filters = 16
    for stage in range(3):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            y = conv_bn(x, filters, strides)
            y = conv_bn(y, filters, activation=False)
            if strides != 1:
                x = layers.Conv2D(filters, 1, strides=strides, padding="same",
                                  kernel_initializer="he_normal")(x)
            x = layers.Activation("relu")(layers.add([x, y]))
        filters *= 2
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, activation="softmax", kernel_initializer="he_normal")(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}_v1")
