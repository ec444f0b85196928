"""The digits job with its durable tier in a bucket (``checkpoint.durable: gs://...`` on the GCS
emulator, ``s3://`` on moto), its machine lost mid-run: the local tier is gone and the run
resumes from the bucket, ending with the weights of its uninterrupted run. On s3 the worker is
killed twice before (mid-epoch, between epochs), the mirror carrying on across attempts; those
resumes read the local tier, the same whatever the bucket, so gs is spared them (two JAX starts
of the suite's time). The s3 run is in the soak tier: it takes gs's path through another
fsspec store (four JAX starts, about 95 s of a suite run), and moto's S3 is the place of
test_objectstore.py's integration tests (outages, checksums, ETags) in every suite run.

Every step is 0.1 s slower from the first (``slow-steps``, in every attempt; the weights do not
change): beside the suite's other processes an attempt otherwise completed the run before its
kill could come."""
import os
import shutil
import signal
import time

import pytest

from helpers import ONE_BACKEND, SOAK, live, start_run, wait_until
from objectstores import BUCKET, GcsEmulator, MotoS3
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive
from orchestrator.core.procid import ProcessIdentity, signal_proven
from test_e2e import (DIGITS_JOB, _completed, _wait_for, _wait_heartbeat,  # noqa: F401
                      digits_reference, write_job_files)

pytestmark = pytest.mark.e2e
SLOWER = ("slow-steps@step=1,for=0.1",)


@pytest.fixture(params=["gs", pytest.param("s3", marks=SOAK)])
def bucket_server(request, tmp_path):
    if request.param == "gs":
        srv = GcsEmulator(str(tmp_path / "gcs")).start()
    else:
        srv = MotoS3().start()
        srv.create_bucket()
    yield srv
    srv.close()


def _wait_past(journal, event, after_step, timeout=120):
    """The first ``event`` (``checkpoint_committed``, ``checkpoint_durable``) of a step past
    ``after_step`` (the supervisor's events carry no attempt)."""
    return wait_until(lambda: next((e for e in journal.iter(event) if e["step"] > after_step),
                                   None), timeout, f"{event} past step {after_step}")


@ONE_BACKEND
def test_a_run_on_a_bucket_whose_machine_is_lost_resumes_from_it_bit_exactly(
        bucket_server, backend, digits_reference, tmp_path):
    write_job_files(tmp_path)
    url, local = f"{bucket_server.scheme}://{BUCKET}/digits", tmp_path / "local"
    job = tmp_path / "job.yaml"
    job.write_text(DIGITS_JOB.replace(
        "checkpoint: {every_epochs: 1, every_steps: 10, keep: 2}",
        f"checkpoint: {{every_epochs: 1, every_steps: 10, keep: 2, durable: '{url}', "
        f"local_dir: '{local}'}}") + f"backend: {backend}\nstandby: off\n")
    env = {**os.environ, **bucket_server.env()}
    run = tmp_path / "run"
    ctl = live(str(job), run)
    journal = Journal(ctl.journal)
    sup = start_run(job, run, SLOWER, env=env)

    n = 1  # the attempt the machine's loss ends
    if bucket_server.scheme == "s3":
        # 1. mid-epoch, once a copy is in the bucket
        pid = _wait_for(journal, "attempt_started", 1)["pid"]
        first = _wait_past(journal, "checkpoint_durable", 0)
        _wait_heartbeat(ctl.control, 1, lambda h: h.get("step", 0) >= first["step"] + 5)
        os.kill(pid, signal.SIGKILL)

        # 2. between epochs
        pid = _wait_for(journal, "attempt_started", 2)["pid"]
        ready = _wait_for(journal, "worker_ready", 2)
        _wait_heartbeat(ctl.control, 2, lambda h: h.get("phase") == "epoch_end"
                        and h["epoch"] > ready["resumed_from_epoch"])
        os.kill(pid, signal.SIGKILL)
        n = 3

    # 3. the machine goes: supervisor and worker killed, the local tier lost with it, once a
    #    copy newer than this attempt's resume is in the bucket. The worker is stopped from its
    #    first commit past it: beside the suite's other processes an upload took 4.5-8 s, and
    #    the run ended before a copy past the resume was in the bucket.
    started = _wait_for(journal, "attempt_started", n)
    pid = started["pid"]
    ready = _wait_for(journal, "worker_ready", n)
    _wait_past(journal, "checkpoint_committed", ready["resumed_from_step"])
    worker = ProcessIdentity.from_record(pid, started["identity"])
    assert signal_proven(worker, signal.SIGSTOP, group=False) is None
    durable = _wait_past(journal, "checkpoint_durable", ready["resumed_from_step"])
    sup.send_signal(signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    sup.wait()
    while pid_alive(pid):
        time.sleep(0.01)
    shutil.rmtree(local)
    again = start_run(job, run, env=env)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out

    events = journal.events()
    resumed = {e["attempt"]: e["resumed_from_step"] for e in events
               if e["event"] == "worker_ready"}
    copies = [e for e in events if e["event"] == "checkpoint_durable"]
    assert copies and all(e["path"].startswith(f"{url}/") for e in copies)
    # the last resume read the bucket: nothing was left locally
    assert sorted(resumed) == list(range(1, n + 2))
    assert resumed[n + 1] >= durable["step"] > 0, (resumed, durable)
    assert not [e for e in events if e["event"] == "resume_not_exact"]
    ref = digits_reference["events"]
    assert _completed(events)["weights_sha256"] == _completed(ref)["weights_sha256"]
    assert _completed(events)["state_sha256"] == _completed(ref)["state_sha256"]
