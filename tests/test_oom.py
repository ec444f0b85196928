"""Telling an OOM kill from a kill from outside: the kernel's counters, its log and the last
resident size, read at the filesystem boundary (fixture cgroup trees), and a real OOM kill under
a memory cgroup this test makes where the machine allows it."""
import os
import subprocess
import sys
import uuid

import pytest

from helpers import ROOT, fake_env
from orchestrator.core.journal import Journal
from orchestrator.recovery import oom
from orchestrator.recovery.failures import classify


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _v2_tree(tmp_path, kills_leaf=0, kills_parent=0, limit="max"):
    root = tmp_path / "cg"
    _write(str(root / "cgroup.controllers"), "cpu memory\n")
    _write(str(root / "user" / "memory.events"), f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills_parent}\n")
    _write(str(root / "user" / "job" / "memory.events"), f"low 0\noom 0\noom_kill {kills_leaf}\n")
    _write(str(root / "user" / "job" / "memory.max"), f"{limit}\n")
    _write(str(tmp_path / "proc" / "42" / "cgroup"), "0::/user/job\n")
    return str(root), str(tmp_path / "proc")


def test_cgroup_v2_dirs_are_the_workers_and_its_parents(tmp_path):
    root, proc = _v2_tree(tmp_path)
    assert oom.memory_cgroups(42, proc, root) == [f"{root}/user/job", f"{root}/user", root]


def test_an_oom_kill_counted_by_a_parent_cgroup_is_evidence(tmp_path):
    root, proc = _v2_tree(tmp_path)
    dirs = oom.memory_cgroups(42, proc, root)
    before = oom.snapshot(dirs)
    _write(f"{root}/user/memory.events", "low 0\noom 2\noom_kill 1\n")
    ev = oom.evidence(before, oom.snapshot(dirs), kmsg=str(tmp_path / "nokmsg"))
    assert ev == f"{root}/user/memory.events: oom_kill 0 -> 1"


def test_unchanged_counters_and_no_log_mean_a_kill_from_outside(tmp_path):
    root, proc = _v2_tree(tmp_path, kills_leaf=4)
    dirs = oom.memory_cgroups(42, proc, root)
    snap = oom.snapshot(dirs)
    assert oom.evidence(snap, oom.snapshot(dirs), pid=42, last_rss=10 << 20,
                        kmsg=str(tmp_path / "nokmsg")) is None


def test_cgroup_v1_oom_control_and_its_limit(tmp_path):
    root = tmp_path / "cg"
    _write(str(root / "memory" / "job" / "memory.oom_control"),
           "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    _write(str(root / "memory" / "job" / "memory.limit_in_bytes"), str(256 << 20))
    _write(str(root / "memory" / "memory.limit_in_bytes"), "9223372036854771712")
    _write(str(tmp_path / "proc" / "7" / "cgroup"), "4:memory:/job\n1:cpu:/\n0::/\n")
    dirs = oom.memory_cgroups(7, str(tmp_path / "proc"), str(root))
    assert dirs[:2] == [str(root / "memory" / "job"), str(root / "memory")]
    snap = oom.snapshot(dirs)
    assert snap.limits == {str(root / "memory" / "job"): 256 << 20}  # "no limit" is no limit
    _write(str(root / "memory" / "job" / "memory.oom_control"),
           "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert "oom_kill 2 -> 3" in oom.evidence(snap, oom.snapshot(dirs), kmsg="/nonexistent")


def test_the_kernel_log_line_for_the_workers_pid(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,100,5,-;eth0: link up\n"
                    "3,101,6,-;Out of memory: Killed process 4321 (python) total-vm:99kB\n")
    empty = oom.Snapshot({}, {})
    assert oom.evidence(empty, empty, pid=4321, kmsg=str(kmsg)) == (
        "kernel log: Out of memory: Killed process 4321 (python) total-vm:99kB")
    assert oom.evidence(empty, empty, pid=432, kmsg=str(kmsg)) is None


def test_a_last_resident_size_at_the_limit_is_evidence(tmp_path):
    root, proc = _v2_tree(tmp_path, limit=str(512 << 20))
    snap = oom.snapshot(oom.memory_cgroups(42, proc, root))
    assert "at the memory limit 512 MiB" in oom.evidence(snap, snap, last_rss=500 << 20,
                                                         kmsg="/nonexistent")
    assert oom.evidence(snap, snap, last_rss=200 << 20, kmsg="/nonexistent") is None


def test_oom_evidence_makes_a_sigkill_out_of_memory_not_a_preemption():
    assert classify(-9).kind == "killed"
    d = classify(-9, oom="memory.events: oom_kill 0 -> 1")
    assert d.kind == "out_of_memory" and "OOM killer" in d.evidence


def _memory_cgroup(limit=160 << 20):
    """A fresh memory cgroup (v1 here; v2 elsewhere) this process may write, or skip."""
    for base, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                             ("/sys/fs/cgroup", "memory.max")):
        if not os.path.exists(os.path.join(base, limit_file if base.endswith("memory")
                                           else "cgroup.controllers")):
            continue
        d = os.path.join(base, f"orchestrator-test-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(d)
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(str(limit))
            return d
        except OSError:
            continue
    pytest.skip("no writable memory cgroup on this machine")


@pytest.mark.integration
def test_a_real_oom_kill_of_the_worker_is_classified_out_of_memory(fake_job, tmp_path):
    """The supervisor and the fake worker run in a 160 MiB memory cgroup made here (as root,
    cgroup v1 on this machine); attempt 1 allocates 400 MiB and the kernel kills it."""
    cg = _memory_cgroup()
    try:
        job = fake_job(epochs=2, restarts="{max: 3, backoff: {initial: 0.01}}")
        code = ("import os, sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
                "open(os.path.join(%r, 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
                "from helpers import fake_commands\n"
                "from orchestrator.core.specload import load\n"
                "from orchestrator.supervise.supervisor import Supervisor\n"
                "sys.exit(Supervisor(load(%r), commands=fake_commands()).run())\n"
                % (os.path.join(ROOT, "tests"), ROOT, cg, job))
        out = subprocess.run([sys.executable, "-c", code], env=fake_env({"allocate_mb": {"1": 400}}),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
        ended = [e for e in events if e["event"] == "attempt_ended"]
        assert ended[0]["signal"] == "SIGKILL" and ended[0]["kind"] == "out_of_memory"
        rec = next(e for e in events if e["event"] == "recovery")
        assert rec["kind"] == "out_of_memory"
        assert ended[-1]["exit_code"] == 0
    finally:
        os.rmdir(cg)


def test_memory_headroom_is_the_least_of_memavailable_and_each_cgroups_limit_less_its_usage(
        tmp_path):
    root, proc = _v2_tree(tmp_path, limit=str(6 * 2**30))
    _write(str(tmp_path / "cg" / "user" / "job" / "memory.current"), f"{5 * 2**30}\n")
    meminfo = str(tmp_path / "meminfo")
    _write(meminfo, "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    # the job's cgroup: 6 GiB limit, 5 GiB used -> 1 GiB, under the machine's ~19 GiB
    assert oom.headroom(meminfo, 42, proc, root) == 2**30
    # no limit ("max"): the machine's
    root, proc = _v2_tree(tmp_path / "nolimit")
    assert oom.headroom(meminfo, 42, proc, root) == 20000000 * 1024
    assert oom.headroom(str(tmp_path / "none"), 42, str(tmp_path / "noproc"), root) is None
