"""The Colab simulator's Drive write-back (tests/fakes/drive_writeback.py), as issue 36 needs
it to be Colab's: a runtime writes into its own cache; a file reaches the cloud only once left
alone for the quiet period, at the bandwidth set; metadata (deletions, renames, folders) at
once; a recycle loses what was not uploaded; ``drive.flush_and_unmount()`` pushes it; a new
runtime sees the cloud only. Real processes and real waiting (the quiet periods are 1-2 s).
"""
import os
import subprocess
import sys
import threading
import time

import pytest

from colabsim import (SIM, cache, cloud, control, env, namespaces_work, new_runtime, run_in,
                      sim, sync_state, wait_for, writeback)
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "fakes"))
import drive_writeback  # noqa: E402

needs_root = pytest.mark.skipif(not namespaces_work(),
                                reason="the simulator's runtimes need `unshare` (root)")
FAST = 1e9  # bytes/s: an upload takes no time worth counting


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "sim"
    h.mkdir()
    yield h
    for runtime in (h / "runtimes").iterdir() if (h / "runtimes").exists() else ():
        sim(h, "_recycle", runtime.name)  # its processes, the sync among them


def _my_drive(home, *parts):
    (cloud(home) / "MyDrive").mkdir(parents=True, exist_ok=True)
    return cloud(home) / "MyDrive" / os.path.join(*parts)


@pytest.mark.parametrize("value, says", [
    ({"quiet_s": 1}, "'writeback.bytes_per_s' must be a number > 0"),
    ({"quiet_s": -1, "bytes_per_s": 5}, "'writeback.quiet_s' must be a number >= 0"),
    ("fast", "'writeback' must be an object")])
def test_bad_writeback_settings_are_refused_naming_the_file_and_key(value, says):
    with pytest.raises(ValueError, match="control.json: " + says.replace(".", r"\.")):
        drive_writeback.settings({"writeback": value}, "control.json")
    assert drive_writeback.settings({"writeback": None}) is None


@pytest.mark.integration
@needs_root
def test_a_file_reaches_the_cloud_only_once_left_alone_for_the_quiet_period(home):
    writeback(home, quiet_s=1.5, bytes_per_s=FAST)
    new_runtime(home, "r1")
    written = float(run_in(home, "r1", "import time\nopen('/content/drive/MyDrive/a.txt', 'w')"
                                       ".write('hello')\nprint(time.time())"))
    assert (cache(home, "r1") / "MyDrive" / "a.txt").read_text() == "hello"
    assert not _my_drive(home, "a.txt").exists()
    wait_for(lambda: [p for p in sync_state(home, "r1")["pending"]
                      if p["path"] == "MyDrive/a.txt"], "a.txt pending")
    wait_for(lambda: _my_drive(home, "a.txt").exists(), "a.txt in the cloud", cap=10)
    arrived = time.time()
    assert arrived - written >= 1.5
    assert arrived - written < 1.5 + 2.0
    assert _my_drive(home, "a.txt").read_text() == "hello"
    assert sync_state(home, "r1")["pending"] == []


@pytest.mark.integration
@needs_root
def test_a_file_appended_without_pause_does_not_upload_while_appended(home):
    writeback(home, quiet_s=2, bytes_per_s=FAST)
    new_runtime(home, "r1")
    appender = subprocess.Popen(
        [SIM, "exec", "-s", "r1", "--timeout", "60"], env=env(home), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_while_appended = []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            if _my_drive(home, "journal.jsonl").exists():
                seen_while_appended.append(time.time())
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        appender.communicate("import time\nfor i in range(12):\n"
                             "    with open('/content/drive/MyDrive/journal.jsonl', 'a') as f:\n"
                             "        f.write('line %d\\n' % i)\n"
                             "    time.sleep(0.5)\n", timeout=90)
    finally:
        watching.set()
        watcher.join()
    assert appender.returncode == 0
    assert seen_while_appended == []  # 6 s of appends, never quiet for 2 s
    wait_for(lambda: _my_drive(home, "journal.jsonl").exists(), "the journal in the cloud",
             cap=10)
    assert _my_drive(home, "journal.jsonl").read_text().count("\n") == 12


@pytest.mark.integration
@needs_root
def test_deletions_renames_and_new_folders_reach_the_cloud_at_once(home):
    (cloud(home) / "MyDrive" / "ckpt").mkdir(parents=True)
    _my_drive(home, "ckpt", "weights.bin").write_bytes(b"w" * 1000)
    _my_drive(home, "old.bin").write_bytes(b"o")
    writeback(home, quiet_s=30, bytes_per_s=FAST)  # nothing is quiet long enough here
    new_runtime(home, "r1")
    run_in(home, "r1", "import os\nd = '/content/drive/MyDrive/'\nos.remove(d + 'old.bin')\n"
                       "os.rename(d + 'ckpt', d + 'ckpt-7')\n"
                       "os.rename(d + 'ckpt-7/weights.bin', d + 'ckpt-7/w.bin')\n"
                       "os.makedirs(d + 'new/deeper')\n"
                       "open(d + 'fresh.tmp', 'w').write('f')\n"
                       "os.rename(d + 'fresh.tmp', d + 'fresh')\n")
    wait_for(lambda: not _my_drive(home, "old.bin").exists(), "the deletion", cap=1.0)
    wait_for(lambda: _my_drive(home, "ckpt-7", "w.bin").exists(), "the renames", cap=1.0)
    assert _my_drive(home, "ckpt-7", "w.bin").read_bytes() == b"w" * 1000
    assert not _my_drive(home, "ckpt").exists()
    wait_for(lambda: _my_drive(home, "new", "deeper").is_dir(), "the new folders", cap=1.0)
    # a file renamed before its content was uploaded: neither name in the cloud yet
    assert not _my_drive(home, "fresh").exists() and not _my_drive(home, "fresh.tmp").exists()
    assert [p["path"] for p in sync_state(home, "r1")["pending"]] == ["MyDrive/fresh"]


@pytest.mark.integration
@needs_root
def test_a_recycle_loses_the_unsettled_writes_and_a_new_runtime_sees_only_the_cloud(home):
    _my_drive(home, "kept.txt").write_text("cloud's")
    writeback(home, quiet_s=30, bytes_per_s=FAST)
    new_runtime(home, "r1")
    run_in(home, "r1", "d = '/content/drive/MyDrive/'\nopen(d + 'kept.txt', 'w').write('new')\n"
                       "open(d + 'unsettled.txt', 'w').write('u')\n")
    new_runtime(home, "r2")  # mounts while r1 holds its writes
    seen = run_in(home, "r2", "import os\nd = '/content/drive/MyDrive/'\n"
                              "print(sorted(os.listdir(d)), open(d + 'kept.txt').read())\n"
                              "open(d + 'from-r2.txt', 'w').write('2')\n")
    assert "['kept.txt'] cloud's" in seen
    assert "from-r2.txt" not in run_in(home, "r1", "import os\n"
                                                   "print(os.listdir('/content/drive/MyDrive'))")
    assert sim(home, "_recycle", "r1").returncode == 0
    assert not cache(home, "r1").exists()
    assert sync_state(home, "r1")["lost"] is True
    assert _my_drive(home, "kept.txt").read_text() == "cloud's"
    assert not _my_drive(home, "unsettled.txt").exists()


@pytest.mark.integration
@needs_root
def test_flush_and_unmount_uploads_everything_pending_at_the_bandwidth_then_unmounts(home):
    writeback(home, quiet_s=30, bytes_per_s=1e6)
    new_runtime(home, "r1")
    said = run_in(home, "r1", "import os, time\nfrom google.colab import drive\n"
                              "drive.mount('/content/drive')\n"
                              "open('/content/drive/MyDrive/big.bin', 'wb').write(b'b' * 1500000)\n"
                              "try:\n    drive.flush_and_unmount(timeout_ms=300)\n"
                              "except ValueError as exc:\n    print('raised', exc)\n"
                              "t = time.time()\ndrive.flush_and_unmount()\n"
                              "print('took', time.time() - t)\n"
                              "print('mounted', os.path.isdir('/content/drive/MyDrive'))\n"
                              "drive.flush_and_unmount()\n")
    assert "Drive already mounted at /content/drive; to attempt to forcibly remount" in said
    assert "raised flush_and_unmount failed" in said  # 1.5 MB at 1 MB/s: not in 0.3 s
    took = float(said.split("took ")[1].split()[0])
    assert 0.5 <= took < 5  # the rest of the 1.5 s upload, blocking
    assert "mounted False" in said
    assert "Drive not mounted, so nothing to flush and unmount." in said
    assert _my_drive(home, "big.bin").stat().st_size == 1500000
    assert sync_state(home, "r1")["alive"] is False  # the sync ended with the unmount
    # a later exec finds Drive unmounted; mount() makes a new cache from the cloud
    said = run_in(home, "r1", "import os\nfrom google.colab import drive\n"
                              "print(os.path.isdir('/content/drive/MyDrive'))\n"
                              "drive.mount('/content/drive')\n"
                              "print(os.listdir('/content/drive/MyDrive'))\n")
    assert said.split() == ["False", "Mounted", "at", "/content/drive", "['big.bin']"]
    assert sync_state(home, "r1")["alive"] is True


@pytest.mark.integration
@needs_root
def test_without_writeback_every_runtime_shares_the_cloud_directly(home):
    control(home, writeback=None)
    new_runtime(home, "r1")
    run_in(home, "r1", "open('/content/drive/MyDrive/now.txt', 'w').write('n')")
    assert _my_drive(home, "now.txt").read_text() == "n"
    assert sync_state(home, "r1") is None and not cache(home, "r1").exists()
