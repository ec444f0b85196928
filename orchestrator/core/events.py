"""Every event name the journal (events.jsonl) can hold, defined once.

Both processes write events (the supervisor most, the worker ``worker_ready``, ``first_step``,
``fault_injected``, ``resume_not_exact``, ``checkpoint_skipped``, ``standby_ready`` and the
checkpoint writer's ``checkpoint_written``, ``checkpoint_skipped_busy``, ``checkpoint_waited``);
status, the timeline and the report read them. Names are plain strings in the file, so a
journal stays readable by
``jq`` and by older versions.
"""
from __future__ import annotations


class Event:
    """The journal's event names (``Event.RUN_STARTED == "run_started"``)."""

    #: the run directory cannot be written (a Drive mount gone); its files are kept locally
    RUN_DIR_UNREACHABLE = "run_dir_unreachable"
    #: ... and can be again (``outage_s``, ``down_since``, what was ``held_back``)
    RUN_DIR_RESTORED = "run_dir_restored"
    #: the lock could not be refreshed for the lease: the worker is paused (SIGSTOP) so that
    #: a supervisor on another VM that takes the stale lock over never trains beside it
    WORKER_PAUSED = "worker_paused"
    #: the lock is ours again: the paused worker goes on (SIGCONT)
    WORKER_RESUMED = "worker_resumed"
    #: another supervisor took the run directory over during an outage: this one stops
    LOCK_LOST = "lock_lost"
    #: a supervisor session starts a new run
    RUN_STARTED = "run_started"
    #: a supervisor session resumes a run
    RUN_RESUMED = "run_resumed"
    #: the last epoch is committed (or a callback ended training)
    RUN_COMPLETED = "run_completed"
    #: the policy gave up
    RUN_FAILED = "run_failed"
    #: the supervisor was stopped (signal, notebook interrupt)
    SUPERVISOR_STOPPED = "supervisor_stopped"
    #: the lock of a dead supervisor was taken over
    LOCK_TAKEN_OVER = "lock_taken_over"
    #: a dead supervisor's worker (``attempt``, ``rank``) or standby (``standby_for_attempt``)
    #: was stopped: its pid was still the process started (core/procid.py)
    ORPHAN_WORKER_KILLED = "orphan_worker_killed"
    #: ... or left alone (``reason``): the pid is gone, is another process now (start time,
    #: command line or boot differ), ran on another host, had no identity recorded (a journal
    #: of an older version), or could not be signalled
    PROCESS_LEFT_ALONE = "process_left_alone"
    #: resumed under a changed training hash (--force)
    RESUME_FORCED = "resume_forced"
    #: a new run moved an earlier run's local checkpoints aside
    LOCAL_CHECKPOINTS_SET_ASIDE = "local_checkpoints_set_aside"
    #: a worker process was started
    ATTEMPT_STARTED = "attempt_started"
    #: the worker built its model and restored (start-up phases)
    WORKER_READY = "worker_ready"
    #: the attempt's first training step is done
    FIRST_STEP = "first_step"
    #: a standby worker was started behind a training one (``for_attempt``, ``pid``, ``mode``)
    STANDBY_STARTED = "standby_started"
    #: the standby has warmed up (imported TensorFlow; in mode ``warm`` also built the model
    #: and traced the train step) and waits for promotion; ``rss`` is what it holds
    STANDBY_READY = "standby_ready"
    #: the standby (warmed up) became the next attempt instead of a fresh process
    STANDBY_PROMOTED = "standby_promoted"
    #: the standby was stopped unused (``reason``: the recovery needs a fresh process, the run
    #: ended, the supervisor stopped)
    STANDBY_DISCARDED = "standby_discarded"
    #: the standby exited on its own (``exit_code``, its log's last line)
    STANDBY_LOST = "standby_lost"
    #: whether attempts get a standby, and why in figures (``mode``: the mode or None,
    #: ``reason``, ``for_attempt``); journaled when the decision changes
    STANDBY_DECIDED = "standby_decided"
    #: the worker got SIGTERM (a preemption notice), saved its state (``step``) and exited
    PREEMPTED = "preempted"
    #: the supervisor is Ray's driver now (``address``, ``auth``: the cluster's authentication
    #: mode it connected in, ``connect_s``; supervise/rayconnect.py)
    ENGINE_CONNECTED = "engine_connected"
    #: ... or could not be, within ``timeout_s`` (``reason``, one line): the run does not start
    ENGINE_UNAVAILABLE = "engine_unavailable"
    #: the engine is placing a group's ranks (Ray: waiting for its placement group), for at most
    #: ``timeout_s`` (None: no wait)
    GROUP_PLACING = "group_placing"
    #: ... placed (``placed``: true, ``wait_s``, ``hosts``, the ranks' ``addresses``) or not
    #: (``reason``)
    GROUP_PLACED = "group_placed"
    #: a rank of a multi-worker group failed: the others are stopped (supervise/group.py);
    #: ``lost``: its Ray actor died with it (the exception's first line); the rank is the first
    #: to exit non-zero where it ran (``group.first_failed``), ``also_failed`` the ranks that
    #: failed on their own after it (a collective it broke)
    GROUP_MEMBER_FAILED = "group_member_failed"
    #: a node left the cluster (stopped, drained, or dead by the cluster's health checks) and
    #: took its ranks: ``node`` (its address), ``node_id`` (Ray's), ``ranks``, ``reason``. After
    #: ``group_member_failed``; the attempt ends as ``killed`` (a preemption's budget) and the
    #: next group waits for capacity within the placement bound (``group_placing``)
    NODE_LOST = "node_lost"
    #: before a group restarts, the last chief's node (not the supervisor's) made durable what
    #: it held only on its local disk: ``node``, ``copied`` and ``pending`` (steps), or the
    #: ``reason`` it could not be asked (supervise/rayengine.py's ``gather_from``)
    CHECKPOINTS_GATHERED = "checkpoints_gathered"
    #: the worker process exited (kind when it failed)
    ATTEMPT_ENDED = "attempt_ended"
    #: no heartbeat for hang_timeout
    HANG_DETECTED = "hang_detected"
    #: the accelerator was probed
    ACCELERATOR_PROBE = "accelerator_probe"
    #: a probe failed while a worker ran
    ACCELERATOR_LOST = "accelerator_lost"
    #: the policy's action for a failed attempt
    RECOVERY = "recovery"
    #: the next attempt is started after a delay
    RESTART = "restart"
    #: an injected fault fired
    FAULT_INJECTED = "fault_injected"
    #: a resume that cannot be bit-exact, and why
    RESUME_NOT_EXACT = "resume_not_exact"
    #: an epoch is covered by a committed checkpoint
    EPOCH_COMPLETED = "epoch_completed"
    #: a checkpoint was committed (either tier); ``state_bytes``: the size of the state it holds
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    #: a checkpoint due was not written, and why
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    #: the worker finished writing a checkpoint (``writer`` background or inline): ``stall_ms``
    #: is what taking it cost the training thread, ``write_ms`` the write itself
    CHECKPOINT_WRITTEN = "checkpoint_written"
    #: a periodic checkpoint fell due while the previous one was still being written: not taken
    CHECKPOINT_SKIPPED_BUSY = "checkpoint_skipped_busy"
    #: ... or the training thread waited ``wait_ms`` for the write in flight, and why
    CHECKPOINT_WAITED = "checkpoint_waited"
    #: a checkpoint was copied to the durable tier and read back
    CHECKPOINT_DURABLE = "checkpoint_durable"
    #: a durable copy reached the cloud (checkpoint/settle.py): ``steps``, ``how`` (mount: a
    #: new runtime's mount shows it; flush: a flush said so; estimate: its size over the
    #: upload rate, with a margin, has passed since it was written), and the figures
    CHECKPOINT_SETTLED = "checkpoint_settled"
    #: the durable tier's space cap (``checkpoint.durable_max_bytes``) forced retention's hand:
    #: ``removed`` steps it would have kept, or ``over_bytes`` it cannot honour without leaving
    #: the tier without a settled checkpoint
    DURABLE_CAP = "durable_cap"
    #: a new runtime found the durable tier behind the progress journaled before it: ``steps``
    #: [N, M] never reached Drive, ``lost_s`` the training time they cost (goodput charges it)
    DURABLE_LOST = "durable_lost"
    #: the end of a run or a planned stop flushed Drive (``ok``, ``seconds``) and checked what
    #: is settled (``settled``, ``not_settled``: the final checkpoint, the export, the journal)
    DRIVE_FLUSHED = "drive_flushed"
    #: retention removed checkpoints
    CHECKPOINTS_RETIRED = "checkpoints_retired"
    #: the durable tier failed
    DURABLE_UNREACHABLE = "durable_unreachable"
    #: the durable tier works again
    DURABLE_RESTORED = "durable_restored"
    #: checkpoints not yet durable
    DURABLE_BACKLOG = "durable_backlog"
    #: a pass of the durable mirror raised an error that is no outage (not an OSError: a
    #: library's own exception type, a bug): ``error``, ``retry_in_s``; the mirror lives on and
    #: tries again (journaled once per error text; the checkpoints stay local meanwhile,
    #: ``durable_backlog`` says which)
    DURABLE_MIRROR_FAILED = "durable_mirror_failed"
    #: the remount hook ran
    REMOUNT = "remount"
    #: the model for inference was written
    EXPORTED = "exported"
    #: the export failed
    EXPORT_FAILED = "export_failed"

    # The outer loop (``orchestrator colab``, orchestrator/colab/): written by the driver on the
    # user's machine into its own journal (core/hosts.py), which it also copies to the run
    # directory; each names the runtime's ``session`` (the Colab CLI's session name).
    #: a runtime of ``kind`` is asked for (``n``: the how-manieth)
    RUNTIME_REQUESTED = "runtime_requested"
    #: ... and refused (``reason``: capacity, usage_limit, error; ``line``: the CLI's own words;
    #: ``retry_in_s``: the backoff before the next request)
    RUNTIME_REFUSED = "runtime_refused"
    #: ... and given (``took_s``)
    RUNTIME_ALLOCATED = "runtime_allocated"
    #: Drive is mounted and the orchestrator installed there (``host``, ``setup_s``)
    RUNTIME_READY = "runtime_ready"
    #: ``orchestrator run`` was started detached in the runtime (``pid``)
    REMOTE_RUN_STARTED = "remote_run_started"
    #: ... and refused the run directory's lock: another runtime's supervisor may still hold
    #: it (core/lock.py's takeover rule); started again after ``retry_in_s``
    REMOTE_RUN_LOCKED = "remote_run_locked"
    #: a runtime's session is over (``why``: completed, lost, unreachable, supervisor_died,
    #: failed, stopped, setup_failed; ``lasted_s``; ``step``: the run's last known step)
    RUNTIME_ENDED = "runtime_ended"
    #: the outer loop is done (``how``: completed, failed, login_expired, budget, interrupted;
    #: ``line``: what the user was told)
    OUTER_ENDED = "outer_ended"


ALL = frozenset(v for k, v in vars(Event).items() if k.isupper())

# The parts of the run directory whose outages are journaled (core/outage.py), each with its
# pair of events: (it stopped answering, it answers again). Status and the report read them
# back through this table.
RUN_DIR, CHECKPOINTS = "run_dir", "checkpoints"
OUTAGE_EVENTS = {
    RUN_DIR: (Event.RUN_DIR_UNREACHABLE, Event.RUN_DIR_RESTORED),
    CHECKPOINTS: (Event.DURABLE_UNREACHABLE, Event.DURABLE_RESTORED),
}
