"""The JAX backend's own pieces: the data order, the compile cache, and (in a JAX process with
TensorFlow blocked) the state read mid-``fit`` and the seeding."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import ROOT
from orchestrator.train.backends.jax_backend import array_batches, local_value, rank_rows_of
from orchestrator.train.multiworker import cluster
from orchestrator.train.compile_cache import CompileCache


def _xy(n=10):
    return np.arange(n * 2, dtype="float32").reshape(n, 2), np.arange(n)


def _ids(batches):
    return [list(y) for _, y in batches]


def test_each_epoch_s_order_is_a_function_of_the_seed_and_the_epoch_alone():
    x, y = _xy()
    run = _ids(array_batches(x, y, seed=3, begin=0, end=3, global_batch=4, drop_remainder=False))
    assert run == _ids(array_batches(x, y, 3, 0, 3, 4, False))  # another process, same order
    assert len(run) == 9 and all(sorted(sum(run[i:i + 3], [])) == list(range(10))
                                 for i in (0, 3, 6))  # every example once per epoch
    assert run[:3] != run[3:6]  # reshuffled each epoch
    assert run != _ids(array_batches(x, y, 4, 0, 3, 4, False))  # the seed decides
    # resuming at epoch 1, batch 2 replays exactly the rest of the run
    assert _ids(array_batches(x, y, 3, 1, 3, 4, False, skip_batches=2)) == run[5:]


def test_drop_remainder_leaves_out_the_partial_batch_a_device_split_cannot_take():
    x, y = _xy()
    run = _ids(array_batches(x, y, 0, 0, 1, 4, drop_remainder=True))
    assert [len(b) for b in run] == [4, 4]


def _tf_config(rank, addresses=("127.0.0.1:4001", "127.0.0.1:4002")):
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": list(addresses)},
                                     "task": {"type": "worker", "index": rank}})}


def test_a_group_s_coordinator_is_rank_0_s_address_and_each_rank_listens_on_its_own_host():
    ranks = [cluster(_tf_config(r, ("127.0.0.1:4001", "10.0.0.2:4002"))) for r in (0, 1)]
    assert [c.coordinator for c in ranks] == ["127.0.0.1:4001"] * 2
    assert [c.host for c in ranks] == ["127.0.0.1", "10.0.0.2"]


def test_the_ranks_together_feed_exactly_the_global_batches_of_one_process():
    """Rank r feeds rows [r * per_rank, (r + 1) * per_rank) of every global batch: what lands
    on its devices when one process holds them all."""
    x, y = _xy(19)
    whole = _ids(array_batches(x, y, 3, 0, 2, 8, drop_remainder=True, skip_batches=1))
    ranks = [cluster(_tf_config(r)) for r in (0, 1)]
    parts = [_ids(array_batches(x, y, 3, 0, 2, 8, True, skip_batches=1, rows=c.rows(8)))
             for c in ranks]
    assert [len(b) for b in parts[0]] == [4] * len(whole)  # the uneven last batch is dropped
    assert [a + b for a, b in zip(*parts)] == whole
    with pytest.raises(ValueError, match="cannot be split evenly over 2 workers"):
        ranks[0].rows(7)


def test_a_rank_s_validation_rows_are_its_part_of_every_whole_global_batch():
    parts = [list(rank_rows_of(19, 8, cluster(_tf_config(r)).rows(8))) for r in (0, 1)]
    assert parts == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]  # 16.. dropped
    assert list(rank_rows_of(5, 8, slice(0, 4))) == []


def test_a_tf_data_job_s_ranks_together_feed_exactly_its_global_batches():
    tf = pytest.importorskip("tensorflow")
    from orchestrator.train.backends.jax_backend import _rank_part
    from orchestrator.train.datasets import JobData, train_dataset

    x, y = _xy(19)
    data = JobData(tf.data.Dataset.from_tensor_slices((x, y)), None, 19)
    ids = lambda ds: [list(b[1].numpy()) for b in ds]  # noqa: E731
    whole = ids(train_dataset(data, 3, 0, 2, 8, drop_remainder=True))
    parts = [ids(_rank_part(train_dataset(data, 3, 0, 2, 8, True),
                            cluster(_tf_config(r)).rows(8))) for r in (0, 1)]
    assert len(whole) == 4 and [a + b for a, b in zip(*parts)] == whole
    assert {len(b) for b in parts[1]} == {4}


def test_a_tf_data_job_with_seed_0_gets_the_same_order_as_any_seed_each_epoch_its_own(
        monkeypatch):
    """``seed: 0`` sets TensorFlow's global seed to 0, where a seed tensor failed its seed check
    ("Using a symbolic tf.Tensor as a Python bool") before the first step."""
    tf = pytest.importorskip("tensorflow")
    from orchestrator.train.datasets import JobData, train_dataset

    x, y = _xy(19)
    data = JobData(tf.data.Dataset.from_tensor_slices((x, y)), None, 19)
    tf.random.set_seed(0)
    try:
        epochs = [[int(i) for b in train_dataset(data, 0, e, e + 1, 8, True) for i in b[1]]
                  for e in (0, 1)]
        both = [int(i) for b in train_dataset(data, 0, 0, 2, 8, True) for i in b[1]]
        skipped = [int(i) for b in train_dataset(data, 0, 0, 2, 8, True, skip_batches=1)
                   for i in b[1]]
    finally:
        tf.random.set_seed(None)
    assert both == epochs[0] + epochs[1] and skipped == both[8:]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != epochs[0]


class _Spanning:
    """A jax.Array over several processes' devices, as far as ``local_value`` asks."""

    is_fully_addressable = False
    shape, sharding = (2,), "NamedSharding(P('batch'))"

    def __init__(self, replicated):
        self.is_fully_replicated = replicated

    def addressable_data(self, i):
        return f"local shard {i}"


def test_a_replicated_variable_is_read_from_this_process_s_own_copy():
    assert local_value(_Spanning(replicated=True)) == "local shard 0"
    here = np.arange(3)
    assert local_value(here) is here  # all on this process: as it is
    with pytest.raises(ValueError, match="sharded over other processes' devices"):
        local_value(_Spanning(replicated=False))


def test_the_compile_cache_is_pulled_on_a_new_disk_and_pushed_after_compiling(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "run" / "jax-cache"
    durable.mkdir(parents=True)
    (durable / "old-entry").write_bytes(b"exe")
    cache = CompileCache(str(local), str(durable))
    assert cache.pull() == 1 and (local / "old-entry").read_bytes() == b"exe"
    (local / "new-entry").write_bytes(b"exe2")
    (local / ".tmp-half-written").write_bytes(b"x")  # a copy in progress is never mirrored
    assert cache.push() == 1
    assert sorted(os.listdir(durable)) == ["new-entry", "old-entry"]
    assert cache.push() == 0  # nothing new


def test_a_run_directory_that_is_gone_costs_the_cache_nothing_but_a_line(tmp_path, capsys):
    (tmp_path / "run").write_text("a file where the folder should be")
    cache = CompileCache(str(tmp_path / "local"), str(tmp_path / "run" / "jax-cache"))
    assert cache.pull() == 0
    (tmp_path / "local" / "entry").write_bytes(b"exe")
    assert cache.push() == 0 and cache.push() == 0
    assert capsys.readouterr().out.count("compile cache:") == 1  # said once


def test_jax_s_own_cache_setting_is_taken_as_the_local_folder(tmp_path):
    class Spec:
        run_dir = str(tmp_path / "run")

        class checkpoint:
            local_dir = str(tmp_path / "tier" / "checkpoints")

    default = CompileCache.for_spec(Spec, env={})
    assert default.local == str(tmp_path / "tier" / "jax-cache")
    assert default.durable == str(tmp_path / "run" / "jax-cache")
    mine = CompileCache.for_spec(Spec, env={"JAX_COMPILATION_CACHE_DIR": "/shared/cache"})
    assert mine.local == "/shared/cache" and mine.shared and not default.shared


def test_a_shared_cache_mirrors_only_what_this_run_compiled(tmp_path):
    """JAX_COMPILATION_CACHE_DIR set: other runs' entries stay out of this run's directory;
    what the run directory had is pulled, and what this run compiles is pushed."""
    local, durable = tmp_path / "machine-cache", tmp_path / "run" / "jax-cache"
    local.mkdir()
    (local / "other-run-entry").write_bytes(b"theirs")
    durable.mkdir(parents=True)
    (durable / "run-entry").write_bytes(b"ours, earlier")
    cache = CompileCache(str(local), str(durable), shared=True)
    assert cache.pull() == 1
    (local / "compiled-now").write_bytes(b"ours")
    assert cache.push() == 1
    assert sorted(os.listdir(durable)) == ["compiled-now", "run-entry"]
    # the default folder is this run's own: everything it holds is mirrored
    own = CompileCache(str(local), str(tmp_path / "run2" / "jax-cache"))
    own.pull()
    assert own.push() == 3


# In a JAX process where `import tensorflow` fails: seed, build, and read the whole state in
# the middle of fit, where the JAX trainer has emptied the Keras variables.
_MID_FIT = textwrap.dedent("""
    import sys
    sys.modules["tensorflow"] = None  # any import of TensorFlow fails
    import os
    os.environ["KERAS_BACKEND"] = "jax"
    import numpy as np
    from orchestrator.train import backends, state
    backend = backends.for_name("jax")
    backend.import_framework()
    backend.seed(1, True)
    import keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype("int32")
    taken = {}
    snap = state.Snapshot(model)

    class Take(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:  # the writer's warm-up, in its own thread, as training goes on
                import threading
                t = threading.Thread(target=snap.warm)
                t.start()
                t.join()
                taken["warmed"] = dict(snap._buffers)
            if batch == 2:
                taken["snapshot"] = snap.take()
                taken["metrics"] = state.capture_metrics(model)
                taken["print"] = state.state_fingerprint(model)

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[Take()], verbose=0)
    arrays = taken["snapshot"]
    assert all(np.isfinite(a).all() for a in arrays.values()), "non-finite state"
    assert any(k.startswith("optimizer.") for k in arrays)
    # the optimizer had taken 3 steps when the state was read mid-fit
    assert int(arrays["optimizer.0000"]) == 3, arrays["optimizer.0000"]
    # the first snapshot copied into the buffers the warm-up allocated and faulted in
    assert taken["warmed"].keys() == arrays.keys(), sorted(taken["warmed"])
    assert all(arrays[k] is taken["warmed"][k] for k in arrays), "buffers allocated again"
    assert float(taken["metrics"]["metrics.0001"]) > 0  # the running count of the epoch
    print("OK", len(arrays), "tensorflow" in sys.modules and sys.modules["tensorflow"] is not None)
""")


@pytest.mark.e2e
def test_the_state_is_read_mid_fit_on_jax_without_importing_tensorflow(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_BACKEND="jax")
    p = subprocess.run([sys.executable, "-c", _MID_FIT], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().split()[0] == "OK" and p.stdout.strip().endswith("False")


def test_exact_resume_is_promised_only_where_it_was_measured():
    from orchestrator.train.backends import Placement, exactness
    from orchestrator.train.backends.jax_backend import JaxBackend
    from orchestrator.train.backends.tf_backend import TensorFlowBackend

    def on(described):
        return Placement(None, described, 1, False, True, False)

    assert exactness(on("CPU (JAX, cpu)"), True, JaxBackend.exact_on) is None
    assert exactness(on("GPU (JAX, NVIDIA H200)"), True, JaxBackend.exact_on) is None
    why = exactness(on("TPU (JAX, TPU v5 lite)"), True, JaxBackend.exact_on)
    assert why and "not verified on TPU" in why
    assert "not verified on GPU" in exactness(on("GPU (/device:GPU:0)"), True,
                                              TensorFlowBackend.exact_on)
    assert exactness(on("CPU x8"), True, TensorFlowBackend.exact_on) is None
    assert exactness(on("CPU"), False, JaxBackend.exact_on) == "deterministic is off"


# A process joins a (one-rank) group on 127.0.0.1 with SIGTERM handled by Python, as the worker's
# is (preemption.py); then it is sent SIGTERM and lists what it listens on.
_JOIN = textwrap.dedent("""
    import os, signal, sys, time
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    os.environ["JAX_PLATFORMS"] = "cpu"
    from orchestrator.train.backends.jax_backend import join_group
    from orchestrator.train.multiworker import Cluster
    join_group(Cluster(0, 1, (sys.argv[1],)))
    import jax
    jax.numpy.ones(2).block_until_ready()  # the CPU client exists, with its collectives
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor, closed since
            continue
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and f"socket:[{inode}]" in mine:  # LISTEN, ours
                listening.append(local)
    print("SIGTERM", bool(got), "LISTEN", " ".join(listening), flush=True)
    os._exit(0)
""")


def _loopback(hex_address: str) -> bool:
    """/proc/net/tcp's ``ADDR:PORT`` in hex: 127.0.0.1 (``0100007F``), or IPv4-mapped or ::1
    in tcp6."""
    addr = hex_address.split(":")[0]
    return addr == "0100007F" or addr.endswith("0100007F") and "FFFF" in addr or \
        addr == "00000000000000000000000001000000"


@pytest.mark.e2e
def test_a_rank_listens_on_its_group_s_addresses_only_and_sigterm_stays_the_worker_s(tmp_path):
    """join_group binds the coordination service to rank 0's address (JAX's default: every
    interface) and leaves SIGTERM to the worker's handler (JAX's preemption service would take
    it: the emergency checkpoint would never run)."""
    from orchestrator.supervise.group import free_port

    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_BACKEND="jax")
    p = subprocess.run([sys.executable, "-c", _JOIN, f"127.0.0.1:{free_port()}"],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SIGTERM")), None)
    assert line is not None, p.stdout + p.stderr
    words = line.split()
    assert words[1] == "True", line  # the worker's handler ran
    listening = words[3:]
    assert listening and all(_loopback(a) for a in listening), line
