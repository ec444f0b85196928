"""A KerasHub BERT backbone built from its config (no download), LoRA on its attention, and a
classification head, trained on synthetic tokens. Plain Keras and KerasHub; nothing
orchestrator-specific.

Under LoRA almost every weight is frozen: ``enable_lora`` leaves only the low-rank factors of
the query and value projections trainable, and the head is the one other trainable layer. That
is the fine-tune our users run on Colab (a KerasHub Gemma or BERT with LoRA), at a size that
trains in seconds on a CPU.

KerasHub: ``pip install --no-deps keras-hub regex tokenizers`` (README's "A job"). A plain
``pip install keras-hub`` pulls ``tensorflow-text`` on Linux, and with it the full
``tensorflow`` over ``tensorflow-cpu`` (or over a TPU runtime's JAX-only image); a backbone
built from a config needs neither the tokenizers' TensorFlow ops nor a download.
"""
import numpy as np

INPUTS = ("token_ids", "padding_mask", "segment_ids")


def load_data(examples: int = 512, vocabulary_size: int = 2048, sequence_length: int = 32,
              num_classes: int = 2, validation_fraction: float = 0.125):
    """Seeded random sentences of varying length, padded; the label says whether the first
    token is in the lower half of the vocabulary (something attention has to find)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(sequence_length // 4, sequence_length + 1, examples)
    tokens = rng.integers(1, vocabulary_size, (examples, sequence_length)).astype("int32")
    mask = np.arange(sequence_length)[None, :] < lengths[:, None]
    tokens = np.where(mask, tokens, 0).astype("int32")
    x = {"token_ids": tokens, "padding_mask": mask.astype("int32"),
         "segment_ids": np.zeros_like(tokens)}
    y = (tokens[:, 0] * num_classes // vocabulary_size).astype("int32")
    n_val = int(examples * validation_fraction)
    return {"train": ({k: v[n_val:] for k, v in x.items()}, y[n_val:]),
            "validation": ({k: v[:n_val] for k, v in x.items()}, y[:n_val])}


def build_model(vocabulary_size: int = 2048, num_layers: int = 2, num_heads: int = 2,
                hidden_dim: int = 64, intermediate_dim: int = 128,
                max_sequence_length: int = 32, lora_rank: int = 4, num_classes: int = 2):
    import keras
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size, num_layers=num_layers, num_heads=num_heads,
        hidden_dim=hidden_dim, intermediate_dim=intermediate_dim,
        max_sequence_length=max_sequence_length)
    backbone.enable_lora(rank=lora_rank)  # the backbone frozen but for the LoRA factors
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in INPUTS}
    pooled = backbone(inputs)["pooled_output"]
    outputs = keras.layers.Dense(num_classes, activation="softmax", name="head")(pooled)
    return keras.Model(inputs, outputs, name="bert_lora_classifier")
