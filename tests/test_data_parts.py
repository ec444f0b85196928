"""The data a job may give, as Keras's ``fit`` takes it (train/datasets.py): x alone, (x, y),
(x, y, sample_weight), dicts and tuples of arrays; and the JAX backend's batches of any of
them, in the (seed, epoch) order. NumPy only: no framework is imported."""
import numpy as np
import pytest

from orchestrator.train import datasets
from orchestrator.train.backends.jax_backend import array_batches, part_batches

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10)


def test_x_alone_is_a_part_of_its_own_and_keras_s_unpacking_rule_applies():
    data = datasets.normalise(X, "job.yaml: key 'data'")
    assert data.num_examples == 10 and data.validation is None and data.train is not None
    assert datasets.unpack(data.train)[1:] == (None, None)
    data = datasets.normalise({"train": {"pixels": X}, "validation": {"pixels": X[:3]}}, "j")
    assert set(data.train) == {"pixels"} and datasets.rows(data.validation) == 3
    x, y, sw = datasets.unpack(((X, X), Y, np.ones(10)))
    assert isinstance(x, tuple) and y is Y and sw.shape == (10,)
    assert datasets.unpack((X,)) == (X, None, None)


def test_sample_weights_and_several_inputs_keep_their_structure():
    data = datasets.normalise({"train": ([X, X], Y, np.ones(10, "float32"))}, "j")
    assert isinstance(data.train[0], tuple)  # a list of inputs becomes a tuple (tf.data)
    batch = datasets.sample_batch(data, 2)
    assert [a.shape for a in datasets.leaves(batch)] == [(2, 2), (2, 2), (2,), (2,)]


@pytest.mark.parametrize("result, expected", [
    ({"train": (X, Y[:9])}, "different numbers of rows (9, 10)"),
    ({"train": (X, Y, Y, Y)}, "x, (x,), (x, y) or (x, y, sample_weight)"),
    ({"train": "pixels.npy"}, "must be arrays"),
    ({"train": X[:0]}, "the training data is empty"),
])
def test_data_that_fit_could_not_take_is_named(result, expected):
    with pytest.raises(datasets.DataError, match="job.yaml: key 'data'") as e:
        datasets.normalise(result, "job.yaml: key 'data'")
    assert expected in str(e.value)


def test_batches_of_any_part_follow_the_same_order_as_an_x_y_pair():
    pairs = list(array_batches(X, Y, 3, 0, 2, 4, False, skip_batches=1))
    alone = list(part_batches(X, 3, 0, 2, 4, False, skip_batches=1))
    named = list(part_batches(({"pixels": X}, Y, Y * 2), 3, 0, 2, 4, False, skip_batches=1))
    assert len(pairs) == len(alone) == len(named) == 5
    for (x, y), (a,), (d, y2, w) in zip(pairs, alone, named):  # x alone comes as (x,)
        assert np.array_equal(x, a) and np.array_equal(x, d["pixels"])
        assert np.array_equal(y, y2) and np.array_equal(w, y * 2)
