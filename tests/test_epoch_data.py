"""The rule for data whose batches the job makes (train/epochdata.py): a ``keras.utils.PyDataset``
or a generator function of the epoch resumes at (epoch e, batch s) with exactly the batches an
uninterrupted run trains on, the PyDataset read from position s (the batches before it never
computed), the generator made again for e and advanced s times; what cannot be resumed exactly
is refused when the data is loaded, naming the job file, the key and what was expected.

Real Keras in this process (``PyDataset`` is its class), no training, no process, no waiting.
"""
import numpy as np
import pytest

from orchestrator.train import datasets

WHERE = "job.yaml: key 'data'"
X = np.arange(40, dtype="float32").reshape(20, 2)
Y = np.arange(20)
keras = epochdata = None


@pytest.fixture(scope="module", autouse=True)
def _keras_imported():
    """Keras imported once for the module, before the fast tier's per-test guard against
    processes (TensorFlow's first import asks ``uname -p``), as tests/test_holders.py does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERAS_BACKEND", "tensorflow")
        pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _keras():
    global keras, epochdata
    keras = pytest.importorskip("keras")
    from orchestrator.train import epochdata


def _pydataset(**kw):
    """Five batches of four; set_epoch draws the example order from (7, epoch); every read is
    recorded as (epoch, index)."""

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(**kw)
            self.epoch, self.reads, self.calls = None, [], []
            self.order = np.arange(20)

        def __len__(self):
            return 5

        def set_epoch(self, epoch):
            self.calls.append(("set_epoch", epoch))
            self.epoch = epoch
            self.order = np.random.default_rng([7, epoch]).permutation(20)

        def on_epoch_end(self):
            self.calls.append(("on_epoch_end", self.epoch))

        def __getitem__(self, i):
            self.reads.append((self.epoch, i))
            idx = self.order[i * 4:(i + 1) * 4]
            return X[idx], Y[idx]

    return Batches()


def _gen_fn(calls=None, short_at=None):
    def batches(epoch):
        if calls is not None:
            calls.append(epoch)
        order = np.random.default_rng([5, epoch]).permutation(20)
        for k, start in enumerate(range(0, 20, 4)):
            if short_at is not None and epoch == short_at and k == 2:
                return
            yield X[order[start:start + 4]], Y[order[start:start + 4]]

    return batches


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert all(np.array_equal(p, q) for p, q in zip(datasets.leaves(a), datasets.leaves(b)))


def test_a_pydataset_resumed_mid_epoch_reads_from_its_position_and_trains_the_same_batches():
    data = datasets.normalise({"train": _pydataset()}, WHERE)
    whole = list(data.train.batches(seed=3, begin=0, end=3))
    resumed_ds = _pydataset()
    resumed = datasets.normalise({"train": resumed_ds}, WHERE)
    resumed_ds.reads.clear()
    tail = list(resumed.train.batches(seed=3, begin=1, end=3, skip=2))
    _same(tail, whole[5 + 2:])
    # the two batches of epoch 1 before the resume point are never read
    order = resumed.train.order(3, 1)
    assert resumed_ds.reads[:3] == [(1, int(i)) for i in order[2:]]
    assert len(resumed_ds.reads) == len(tail)


def test_a_pydataset_s_batch_order_is_drawn_from_seed_and_epoch_unless_shuffle_is_false():
    data = datasets.normalise({"train": _pydataset()}, WHERE).train
    orders = [list(data.order(3, e)) for e in (0, 1)]
    assert sorted(orders[0]) == list(range(5)) and orders[0] != orders[1]
    assert list(data.order(3, 0)) == orders[0]  # the same again: a function of (seed, epoch)
    assert list(data.order(4, 0)) != orders[0]
    kept = datasets.normalise({"train": _pydataset(), "shuffle": False}, WHERE).train
    assert list(kept.order(3, 1)) == list(range(5))


def test_set_epoch_comes_before_an_epoch_s_first_read_and_on_epoch_end_after_its_last():
    ds = _pydataset()
    data = datasets.normalise({"train": ds}, WHERE).train
    ds.calls.clear()
    ds.reads.clear()
    for _ in data.batches(seed=3, begin=0, end=2, skip=4):
        pass
    assert ds.calls == [("set_epoch", 0), ("on_epoch_end", 0), ("set_epoch", 1),
                        ("on_epoch_end", 1)]
    assert [e for e, _ in ds.reads] == [0] + [1] * 5


def test_a_pydataset_read_by_worker_threads_keeps_its_order():
    threaded = datasets.normalise({"train": _pydataset(workers=3, max_queue_size=2)}, WHERE)
    plain = datasets.normalise({"train": _pydataset()}, WHERE)
    _same(list(threaded.train.batches(3, 0, 3, skip=1)), list(plain.train.batches(3, 0, 3, 1)))


def test_a_generator_function_is_made_again_for_the_resumed_epoch_and_advanced_to_its_batch():
    calls = []
    data = datasets.normalise({"train": _gen_fn(calls), "steps_per_epoch": 4}, WHERE)
    assert data.train.steps == 4 and data.num_examples == 16
    whole = list(data.train.batches(seed=3, begin=0, end=3))
    calls.clear()
    tail = list(data.train.batches(seed=3, begin=1, end=3, skip=3))
    _same(tail, whole[4 + 3:])
    assert calls == [1, 2]  # epoch 0 never made; at most steps_per_epoch drawn of each


def test_a_generator_that_runs_out_before_steps_per_epoch_is_named_with_its_epoch():
    data = datasets.normalise({"train": _gen_fn(short_at=1), "steps_per_epoch": 4}, WHERE)
    with pytest.raises(datasets.DataError, match=r"batches\(1\) yielded 2 batch\(es\) but "
                                                 r"steps_per_epoch is 4") as e:
        list(data.train.batches(seed=3, begin=0, end=2))
    assert WHERE in str(e.value)


def test_the_job_s_own_batch_is_the_global_batch_and_several_replicas_or_workers_are_refused():
    data = datasets.normalise({"train": _pydataset()}, WHERE)
    assert datasets.batching(data, 999, False, replicas=1, in_group=False) == (4, 5)
    for replicas, group in ((2, False), (1, True)):
        with pytest.raises(datasets.DataError, match="trains on one device in one process"):
            datasets.batching(data, 8, False, replicas, group)
    batch = datasets.sample_batch(data, 2)
    assert [a.shape for a in datasets.leaves(batch)] == [(2, 2), (2,)]


def _global_rng_pydataset():
    class Noisy(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return X[np.random.permutation(20)[:4]], Y[:4]

    return Noisy()


def _stateful_set_epoch():
    class Drifting(keras.utils.PyDataset):
        order = np.arange(20)

        def __len__(self):
            return 2

        def set_epoch(self, epoch):  # shuffles what the last epoch left: not a function of it
            np.random.default_rng(epoch).shuffle(self.order)

        def __getitem__(self, i):
            return X[self.order[:4]], Y[:4]

    return Drifting()


def _reshuffled_at_epoch_end():
    class Reshuffled(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def on_epoch_end(self):
            pass

        def __getitem__(self, i):
            return X[:4], Y[:4]

    return Reshuffled()


def _infinite():
    class Endless(keras.utils.PyDataset):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return X[:4], Y[:4]

    return Endless()


def _global_rng_generator(epoch):
    for _ in range(3):
        yield X[np.random.permutation(20)[:4]], Y[:4]


@pytest.mark.parametrize("result, expected", [
    (lambda: {"train": _gen_fn()(0), "steps_per_epoch": 4}, "generator object, which cannot be "
     "made again for the epoch"),
    (lambda: _gen_fn()(0), "generator object, which cannot be made again for the epoch"),
    (lambda: {"train": lambda: iter(()), "steps_per_epoch": 4}, "must take the epoch"),
    (lambda: {"train": _gen_fn()}, "needs 'steps_per_epoch'"),
    (lambda: {"train": _gen_fn(), "steps_per_epoch": 0}, "positive integer"),
    (lambda: {"train": _gen_fn(), "steps_per_epoch": 4, "shuffle": False},
     "'shuffle' applies to a PyDataset only"),
    (lambda: {"train": _global_rng_generator, "steps_per_epoch": 3},
     "not the same batch made again"),
    (lambda: {"train": _infinite()}, "is infinite (num_batches is None)"),
    (lambda: {"train": _pydataset(), "steps_per_epoch": 6}, "'steps_per_epoch' is 6 but"),
    (lambda: {"train": _reshuffled_at_epoch_end()}, "defines on_epoch_end but no set_epoch"),
    (lambda: {"train": _pydataset(workers=2, use_multiprocessing=True)},
     "use_multiprocessing=True"),
    (lambda: {"train": _global_rng_pydataset()}, "not the same batch after set_epoch(1)"),
    (lambda: {"train": _stateful_set_epoch()}, "not the same batch after set_epoch(1)"),
    (lambda: {"train": (X, Y), "steps_per_epoch": 4}, "apply to a keras.utils.PyDataset or a "
     "generator function of the epoch only"),
    (lambda: {"train": (X, Y), "validation": _gen_fn()}, "validation data is a function"),
])
def test_data_that_cannot_be_resumed_exactly_is_refused_naming_file_key_and_expectation(
        result, expected):
    with pytest.raises(datasets.DataError) as e:
        datasets.normalise(result(), WHERE)
    assert str(e.value).startswith(WHERE)
    assert expected in str(e.value)


def test_an_infinite_pydataset_with_steps_per_epoch_is_read_from_index_zero_each_epoch():
    data = datasets.normalise({"train": _infinite(), "steps_per_epoch": 3}, WHERE).train
    assert list(data.order(3, 2)) == [0, 1, 2] and len(list(data.batches(3, 0, 2, 1))) == 5
