"""The notebook API in a real Jupyter kernel: progress in the cell, a cell interrupt stops the
worker cleanly, and running the cell again resumes. Fake workers (no TensorFlow)."""
import os
import re
import queue
import time

import pytest

from helpers import ROOT, fake_env
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive

jupyter_client = pytest.importorskip("jupyter_client", reason="needs the test extra")

# integration: a real Jupyter kernel running the supervisor and the fake
# worker: real processes, real waiting
pytestmark = pytest.mark.integration

SETUP = f"""
import sys
sys.path[:0] = [{os.path.join(ROOT, 'tests')!r}, {ROOT!r}]
import orchestrator, orchestrator.api
from orchestrator.supervise.supervisor import Supervisor
from helpers import fake_commands

class FakeWorkerSupervisor(Supervisor):  # the notebook API, with the fake worker
    def __init__(self, spec, **kw):
        super().__init__(spec, commands=fake_commands(), **kw)

orchestrator.api.Supervisor = FakeWorkerSupervisor
"""


class Kernel:
    def __init__(self, env, cwd):
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def execute(self, code, until=None, on_text=None, timeout=120):
        """Run a cell; return (reply content, stream text). ``on_text(text)`` sees the
        output so far after each message."""
        msg_id = self.kc.execute(code)
        text, reply, idle = "", None, False
        deadline = time.time() + timeout
        while time.time() < deadline and not (reply and idle):
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg and msg["parent_header"].get("msg_id") == msg_id:
                if msg["msg_type"] == "stream":
                    text += msg["content"]["text"]
                    if on_text:
                        on_text(text)
                elif msg["msg_type"] == "error":
                    text += "\n".join(msg["content"]["traceback"])
                elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            if reply is None:
                try:
                    r = self.kc.get_shell_msg(timeout=0.01)
                    if r["parent_header"].get("msg_id") == msg_id:
                        reply = r["content"]
                except queue.Empty:
                    pass
        assert reply is not None and idle, f"cell did not finish in {timeout} s:\n{text}"
        return reply, text

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel_for(tmp_path):
    made = []

    def make(plan):
        env = fake_env(plan)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                             env.get("PYTHONPATH", "")])
        k = Kernel(env, str(tmp_path))
        made.append(k)
        reply, text = k.execute(SETUP)
        assert reply["status"] == "ok", text
        return k

    yield make
    for k in made:
        k.close()


def test_cell_shows_progress_and_an_interrupt_stops_the_worker_then_rerun_resumes(
        fake_job, tmp_path, kernel_for):
    job = fake_job(epochs=6)
    run = tmp_path / "run"
    # attempt 1 trains slowly (20 batches of 0.05 s an epoch); attempt 2 finishes quickly
    k = kernel_for({"epoch_s": 1.0, "batches": 20})
    interrupted = []

    def interrupt_after_two_epochs(text):
        if "epoch 2/6 loss" in text and not interrupted:  # the line, not the bar
            interrupted.append(int((run / "fake-1.pid").read_text()))
            k.km.interrupt_kernel()  # what the notebook's stop button does: SIGINT

    reply, text = k.execute(f"rc = orchestrator.run({job!r})", on_text=interrupt_after_two_epochs)
    assert interrupted, text
    worker = interrupted[0]
    # the cell ends as an interrupted call does, after the worker was stopped cleanly
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    assert "stopped; the run resumes" in text
    assert not pid_alive(worker), "the worker outlived the cell interrupt"
    events = Journal(str(run / "events.jsonl")).events()
    assert events[-1]["event"] == "supervisor_stopped"
    assert not (run / "lock").exists(), "the run directory is still locked"
    # progress in the cell: epoch lines with attempt/restarts/checkpoint/ETA, and a live bar
    assert "epoch 1/6 loss=1 | attempt 1, 0 restart(s), checkpoint epoch 1 (step 10)" in text
    assert re.search(r"[\r\n]\[orchestrator\] epoch 2/6 loss=\S+ \| attempt 1, .*, ETA \d",
                     text), text
    # tqdm's text bar (no ipywidgets in this kernel; Colab's has them and gets the widget)
    assert re.search(r"\r\[orchestrator\] epoch [1-3]/6: +\d+%\|[^|\r]*\| \d+/20 ", text), text
    assert "oneDNN" not in text, "TensorFlow-like worker noise reached the cell"

    reply, text = k.execute(f"rc = orchestrator.run({job!r}); print('rc', rc)", timeout=180)
    assert reply["status"] == "ok", text
    assert "rc 0" in text and "resuming run 'fake'" in text
    epochs = [e["epoch"] for e in Journal(str(run / "events.jsonl")).events()
              if e["event"] == "epoch_completed"]
    assert epochs == [1, 2, 3, 4, 5, 6]


CELL_JOB = """
import numpy as np


class Size:
    n = 8

def load_data():
    return {{"train": (np.zeros((Size.n, 2)), np.zeros(Size.n))}}

def build_model():  # the fake worker never calls it
    import keras
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

rc = orchestrator.run(model=build_model, data=load_data, name="cell", epochs=4, batch_size=8,
                      run_dir={run!r})
print("rc", rc)
"""


def test_a_job_defined_in_a_cell_resumes_when_the_same_cell_runs_in_a_new_kernel(
        tmp_path, kernel_for):
    """A recycled VM: the kernel that ran the cell is gone, a new one runs the same cell. The
    functions' pickles differ between the two kernels (cloudpickle gives the cell's class a
    random id); the code they carry does not, so the run resumes instead of being refused."""
    run = tmp_path / "run"
    cell = CELL_JOB.format(run=str(run))
    k = kernel_for({"epoch_s": 0.6, "batches": 6})

    def interrupt_after_one_epoch(text):
        if "epoch 1/4" in text and not k.interrupted:
            k.interrupted = True
            k.km.interrupt_kernel()

    k.interrupted = False
    reply, text = k.execute(cell, on_text=interrupt_after_one_epoch)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    assert "the job's functions (build_model, load_data) are carried in" in text
    first = (run / "code.pkl").read_bytes()
    k.close()

    k2 = kernel_for({"epoch_s": 0.1})
    reply, text = k2.execute(cell, timeout=120)
    assert reply["status"] == "ok", text
    assert "rc 0" in text and "resuming run 'cell'" in text
    assert (run / "code.pkl").read_bytes() != first  # this kernel's pickle, of the same code
    epochs = [e["epoch"] for e in Journal(str(run / "events.jsonl")).events()
              if e["event"] == "epoch_completed"]
    assert epochs == [1, 2, 3, 4]
