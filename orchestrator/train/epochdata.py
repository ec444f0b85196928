"""Data whose batches the job makes itself: a ``keras.utils.PyDataset``, or a generator function
of the epoch. Resumed mid-epoch exactly, under one rule: **the batches of epoch e are a
function of e alone**.

- A **PyDataset**: ``__getitem__(i)`` is a function of ``i`` and of the epoch last given to its
  ``set_epoch(epoch)``, if it defines one (called before each epoch's first batch is drawn).
  The batch order of epoch e is a permutation of its indices drawn from (seed, e), as Keras's
  ``fit`` shuffles a PyDataset's batches (it draws from Python's ``random``, which a resumed
  process does not replay); ``"shuffle": False`` in the data dict keeps the index order. A
  resume at (epoch e, batch s) calls ``set_epoch(e)`` and reads from position s of e's order:
  the batches before it are never computed.
- A **generator function** ``train(epoch)`` returns an iterable of the epoch's batches; the data
  dict gives ``steps_per_epoch``, the batches drawn from each epoch's iterable (a generator
  cannot say how many it has without computing them all; an infinite one is fine). A resume at
  (e, s) calls ``train(e)`` and advances it s times: the skipped batches are computed and
  dropped, as a generator has no way to start elsewhere.

What the rule needs and can be checked is checked when the data is loaded, before training
(``make``): a generator object (it cannot be rebuilt for another epoch), a function that does
not take the epoch, a generator without ``steps_per_epoch``, an infinite PyDataset without it, a
PyDataset whose ``on_epoch_end``/``on_epoch_begin`` may reorder it but which has no
``set_epoch``, one that asks for worker processes, and batches that are not the same when an
epoch is made again (the first batch of epoch 0 is read, then epoch 1's, then epoch 0's again:
an order drawn from a process-wide RNG, or a ``set_epoch`` that shuffles what the last epoch left,
fails here). Several replicas or workers are refused (``fixed``): the batch is the job's, and
splitting it across devices or processes is not done here.
"""
from __future__ import annotations

import collections
import inspect
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from orchestrator.train.batches import leaves, unpack
from orchestrator.train.errors import DataError

PYDATASET = "PyDataset"
GENERATOR = "generator function"


def is_pydataset(obj) -> bool:
    """A ``keras.utils.PyDataset``, asked without importing Keras (one can only exist where it
    was imported)."""
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.utils.PyDataset)


def is_generator_like(obj) -> bool:
    """What a job may mean as a generator: a generator object or any iterator (refused: they
    cannot be made again for an epoch), or a function that is not a Keras or NumPy object."""
    return (inspect.isgenerator(obj) or hasattr(obj, "__next__")
            or (callable(obj) and not isinstance(obj, np.ndarray) and not is_pydataset(obj)))


def as_tuple(batch):
    """A batch as Keras takes it from a generator: a tuple (x alone is ``(x,)``, which
    ``unpack_x_y_sample_weight`` reads as x); a list is a tuple of its items."""
    if isinstance(batch, list):
        return tuple(batch)
    return batch if isinstance(batch, tuple) else (batch,)


@dataclass
class EpochData:
    """``JobData.train`` for a PyDataset or a generator function: ``steps`` batches an epoch,
    ``first`` the first batch of epoch 0 (the sample batch the model is built on)."""

    source: object
    kind: str
    steps: int
    shuffle: bool
    first: tuple
    where: str

    @property
    def rows(self) -> int:
        return len(np.asarray(leaves(self.first)[0]))

    def fixed(self, replicas: int, in_group: bool) -> tuple[int, int]:
        """(global batch, steps per epoch): the job's batch, not ``batch_size`` x replicas (a
        halved ``batch_size`` changes nothing here); one replica in one process only."""
        if replicas > 1 or in_group:
            raise DataError(
                f"{self.where}: a {self.kind} trains on one device in one process; this "
                f"attempt has {replicas} replica(s){' in a group of workers' if in_group else ''}"
                f". Splitting its batches across devices or workers is not supported: set "
                f"strategy: cpu or a single device, workers: 1, or give arrays or a "
                f"tf.data.Dataset")
        return self.rows, self.steps

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s batch indices, in the order they are trained."""
        n = _finite_length(self.source) if self.kind == PYDATASET else None
        if self.shuffle and n is not None:
            return np.random.default_rng([seed, epoch]).permutation(n)[:self.steps]
        return np.arange(self.steps)

    def batches(self, seed: int, begin: int, end: int, skip: int = 0):
        """Batches of epochs ``begin .. end-1`` (each a tuple), less the first ``skip`` of
        ``begin``: for a PyDataset read from that position, for a generator drawn and
        dropped."""
        for epoch in range(begin, end):
            start = skip if epoch == begin else 0
            if self.kind == PYDATASET:
                yield from self._pydataset_epoch(seed, epoch, start)
            else:
                yield from self._generator_epoch(epoch, start)

    def _pydataset_epoch(self, seed: int, epoch: int, start: int):
        ds = self.source
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        ds.on_epoch_begin()
        order = self.order(seed, epoch)[start:]
        for k, batch in enumerate(_read(ds, order)):
            if k == len(order) - 1:  # drawn already: its end, before the last batch is trained
                ds.on_epoch_end()
            yield as_tuple(batch)

    def _generator_epoch(self, epoch: int, start: int):
        it = iter(self.source(epoch))
        for k in range(self.steps):
            batch = next(it, _END)
            if batch is _END:
                raise DataError(
                    f"{self.where}: {_name(self.source)}({epoch}) yielded {k} batch(es) but "
                    f"steps_per_epoch is {self.steps}: every epoch must yield at least that many")
            if k >= start:
                yield as_tuple(batch)


_END = object()


def _name(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _finite_length(ds) -> int | None:
    try:
        n = ds.num_batches
    except NotImplementedError:
        return None
    return None if n is None else int(n)


def _read(ds, order):
    """``ds[i]`` for each index of ``order``, in order; with ``ds.workers`` > 1 read ahead by
    that many threads, at most ``max_queue_size`` batches ahead (Keras's own settings)."""
    workers = int(getattr(ds, "workers", 1) or 1)
    if workers <= 1:
        for i in order:
            yield ds[int(i)]
        return
    ahead = max(int(getattr(ds, "max_queue_size", 10) or 10), workers)
    indices = iter(order)
    with ThreadPoolExecutor(workers, thread_name_prefix="pydataset") as pool:
        pending = collections.deque(pool.submit(ds.__getitem__, int(i))
                                    for _, i in zip(range(ahead), indices))
        try:
            while pending:
                got = pending.popleft().result()
                nxt = next(indices, None)
                if nxt is not None:
                    pending.append(pool.submit(ds.__getitem__, int(nxt)))
                yield got
        finally:
            for f in pending:
                f.cancel()


def _same(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).shape == np.asarray(y).shape and np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def make(train, steps_per_epoch, shuffle, where: str) -> EpochData:
    """``train`` (a PyDataset or a generator function) checked against the rule, or a
    ``DataError`` naming the job file, the key and what was expected. ``steps_per_epoch`` and
    ``shuffle`` are the data dict's (None: not given)."""
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int)
                                        or isinstance(steps_per_epoch, bool)
                                        or steps_per_epoch < 1):
        raise DataError(f"{where}: 'steps_per_epoch' must be a positive integer, got "
                        f"{steps_per_epoch!r}")
    if shuffle is not None and not isinstance(shuffle, bool):
        raise DataError(f"{where}: 'shuffle' must be true or false, got {shuffle!r}")
    if is_pydataset(train):
        return _pydataset(train, steps_per_epoch, shuffle, where)
    if inspect.isgenerator(train) or hasattr(train, "__next__"):
        raise DataError(
            f"{where}: train data is a {type(train).__name__} object, which cannot be made again "
            f"for the epoch a resumed run is in: give the function that makes it, called with "
            f"the epoch (def batches(epoch): ... yield x, y), with 'steps_per_epoch', or a "
            f"keras.utils.PyDataset")
    try:
        inspect.signature(train).bind(0)
    except TypeError:
        raise DataError(f"{where}: {_name(train)}{inspect.signature(train)} must take the epoch "
                        f"as its one argument (def batches(epoch): ...): the batches of an epoch "
                        f"are made again from it when a run resumes") from None
    except ValueError:
        pass  # a builtin: its call says
    if steps_per_epoch is None:
        raise DataError(f"{where}: a generator function as train data needs 'steps_per_epoch' "
                        f"in the data dict (the batches drawn from each epoch's generator): "
                        f"it cannot be counted without computing every batch")
    if shuffle is not None:
        raise DataError(f"{where}: 'shuffle' applies to a PyDataset only; a generator's "
                        f"order is its own")
    firsts = [_first(train, e, where) for e in (0, 1, 0)]
    data = EpochData(train, GENERATOR, steps_per_epoch, False, firsts[0], where)
    _check_again(data, firsts, f"{_name(train)}(0)")
    return data


def _first(fn, epoch: int, where: str):
    batch = next(iter(fn(epoch)), _END)
    if batch is _END:
        raise DataError(f"{where}: {_name(fn)}({epoch}) yielded no batch")
    return as_tuple(batch)


def _pydataset(ds, steps_per_epoch, shuffle, where: str) -> EpochData:
    cls = type(ds).__name__
    if getattr(ds, "use_multiprocessing", False):
        raise DataError(f"{where}: {cls} asks for use_multiprocessing=True: its copies in other "
                        f"processes would not see set_epoch, so the order could not be kept. "
                        f"Use threads (workers=N, use_multiprocessing=False)")
    base = sys.modules["keras"].utils.PyDataset
    reorders = [m for m in ("on_epoch_begin", "on_epoch_end")
                if getattr(type(ds), m, None) is not getattr(base, m)]
    if reorders and not hasattr(ds, "set_epoch"):
        raise DataError(
            f"{where}: {cls} defines {' and '.join(reorders)} but no set_epoch(epoch): a resumed "
            f"process starts without the calls of the epochs before, so an order they change "
            f"cannot be made again. Define set_epoch(self, epoch) that sets epoch's order from "
            f"the epoch alone (e.g. np.random.default_rng([seed, epoch]).permutation(n)); "
            f"{' and '.join(reorders)} may stay for anything else")
    n = _finite_length(ds)
    if n is None and steps_per_epoch is None:
        raise DataError(f"{where}: {cls} is infinite (num_batches is None): give "
                        f"'steps_per_epoch' in the data dict")
    if n is not None and steps_per_epoch is not None and steps_per_epoch > n:
        raise DataError(f"{where}: 'steps_per_epoch' is {steps_per_epoch} but {cls} has "
                        f"{n} batches")
    steps = steps_per_epoch or n
    if steps == 0:
        raise DataError(f"{where}: the training data is empty ({cls} has 0 batches)")
    firsts = []
    for epoch in (0, 1, 0):
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        firsts.append(as_tuple(ds[0]))
    data = EpochData(ds, PYDATASET, steps, shuffle is not False and n is not None, firsts[0],
                     where)
    _check_again(data, firsts, f"{cls}[0]")
    return data


def _check_again(data: EpochData, firsts: list, what: str) -> None:
    if not isinstance(firsts[0], tuple) or not 1 <= len(firsts[0]) <= 3:
        raise DataError(f"{data.where}: {what} is a tuple of {len(firsts[0])} items: a batch "
                        f"is x, (x,), (x, y) or (x, y, sample_weight)")
    if not _same(firsts[0], firsts[2]):
        again = "after set_epoch(1) and set_epoch(0)" if data.kind == PYDATASET else "made again"
        raise DataError(
            f"{data.where}: {what} is not the same batch {again}: the batches of an epoch must "
            f"be a function of the epoch alone (no process-wide RNG such as np.random or "
            f"random, no state left by the previous epoch), or a resumed run would train on "
            f"others")
    if data.rows == 0 or unpack(firsts[0])[0] is None:
        raise DataError(f"{data.where}: {what} has no examples")
