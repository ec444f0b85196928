"""Whether a warm standby is worth it for the run in front of us, from what it can measure.

A standby buys a recovery in a fraction of a cold start (digits: 0.15 s against 3.8 s) but its
warm-up runs on the same cores as the worker. Where the worker trains on an accelerator that
costs nothing that matters; where it trains on the CPU of a small machine it always costs
(scripts/bench on 2 cores, 2026-12-05: ResNet-20 trained 1.8x slower for the ~7 s a standby
took to warm up, once per attempt; a short run paid 1.44-1.56x) and buys nothing unless the
worker is then killed. So ``standby: auto`` decides per attempt, from the run's own journal:

- training on a GPU or a TPU: a standby (the device does the training, the CPU is spare);
- a CPU with cores to spare (``SPARE_CORES`` or more): a standby, its warm-up takes one of them;
- a CPU-bound worker on fewer cores: none until this run has seen a kill (unless the run is
  long: its warm-up's cost at most ``LONG_RUN_SHARE`` of the training left, at the pace of its
  commits; asked again at commits, every ``standby.RETRY_S``), then one when what
  it is expected to save beats what its warm-up costs: (the share of attempts that ended in
  a kill) x (the run's cold start) > (the last warm-up's length) x ``WARM_UP_SLOWDOWN`` x
  2 / cores. Every figure is the run's own where it has one (journaled ``first_step`` of cold
  attempts, ``standby_ready``), the bench's otherwise;
- and none when the next kill is expected before a standby would be ready: kills have come
  every G s (the median of the last three gaps between kills, the first from the session's
  start), the last one T s ago, and a warm-up takes W s (the last one's, or longer if later
  ones were discarded still warming up; the run's cold start until one was ready): none if
  G - T <= W. A standby starts when its
  worker's start-up is done, so after a cold start of C s it has G - C s: measured (bench
  --quick, goodput, ResNet-20 on 2 cores, kills every ~20 s, C ~12 s), every standby was
  discarded still warming up and the run's goodput fell to 0.244 against 0.308 with none. After a
  warm start (C < 1 s) it has nearly all of G;
- and none when the run is expected to end before that next kill: its training left (the
  epochs left at the pace of its committed checkpoints) is at most G - T;
- and none once two standbys in a row were discarded or adopted still warming up (the kills
  come before a standby is ready: its warm-up mostly slows the worker), until killed attempts
  train longer after their first step than the oldest of them had warmed up.

A standby the next attempt finds still warming up is adopted, not discarded
(supervise/standby.py): no recovery is slower than a cold start for having had one.

Before any of these, on any device: none where the memory left (``MemAvailable``, and a
cgroup's limit less its usage) could not hold one (``memory_allows``: a standby holds about as
much as the worker, and one more copy of the state, the newest checkpoint's size); that a GPU's own memory would hold it is not checked here (both workers
then grow their GPU memory as they need it).

``standby: on`` always starts one (where the device allows), ``off`` never; the decision and
its figures are journaled whenever it changes (``standby_decided``).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from orchestrator.core.events import Event

# Measured on 2 cores: a CPU-bound worker loses this share of each second a standby warms up
# beside it; scaled by 2/cores on other machines. scripts/bench --only goodput, 2026-12-05,
# ResNet-20: its epochs took 2.07-2.17 s while each of three standbys warmed up (6.5-6.9 s)
# against 1.12-1.17 s otherwise (1.8x). (An earlier bench, 2026-12-04, had 1.19x over the
# attempts' first epochs; the figure per epoch of the warm-up is the one that counts here.)
WARM_UP_SLOWDOWN = 0.45
# Not measured here (this machine has 2): from 4 cores the standby's mostly single-threaded
# warm-up has a core to itself while the worker's math keeps the rest.
SPARE_CORES = 4
# Until the run has its own figures: the bench's digits cold start and warm-up on 2 cores.
DEFAULT_COLD_START_S = 7.6
DEFAULT_WARM_UP_S = 8.0
# Before any kill, a standby where its warm-up costs at most this share of the training left:
# a long run that is never killed pays at most that (the bound of "no fault-free run slower
# than standby: off by more than noise"), and its first kill recovers warm.
LONG_RUN_SHARE = 0.02
# A standby's memory, x the worker's resident size: it holds about as much, and the worker's
# own grows past the size its heartbeat said (its peak came later in that run)
MEMORY_MARGIN = 1.25
# Standbys discarded still warming up, one after another, before auto stops starting them.
UNREADY_IN_A_ROW = 2


@dataclass(frozen=True)
class Evidence:
    """What the run's journal says so far."""

    attempts_ended: int = 0
    killed: int = 0
    cold_start_s: float | None = None   # median process start -> first step, cold attempts
    warm_up_s: float | None = None      # the last standby: started -> ready
    # standbys discarded still warming up since the last one that was ready: their ages (each a
    # lower bound on a warm-up here), and killed attempts' training time, first step -> kill
    unready_s: tuple = ()
    trained_s: tuple = ()
    # the gaps between kills in this session (the first from its start), and the last kill's time
    kill_gaps_s: tuple = ()
    last_kill_ts: float | None = None
    # where training stands: the newest commit's epoch (with its batches as a fraction of one),
    # the epochs the job trains and its pace (epochs/s between commits)
    epoch: float | None = None
    epochs: int | None = None
    epochs_per_s: float | None = None
    # the newest committed checkpoint's state, in bytes (its manifest's files)
    state_bytes: int | None = None

    def training_left_s(self) -> float | None:
        """Seconds of training left after the newest commit at the run's pace; None when not
        known. Not less the time since that commit: after a kill that time was the restart's
        (bench --quick, 2026-12-05: 6 s of a cold start were taken off a run's 19 s)."""
        if None in (self.epoch, self.epochs) or not self.epochs_per_s:
            return None
        return max(0.0, (self.epochs - self.epoch) / self.epochs_per_s)

    @classmethod
    def from_journal(cls, events, is_kill, epochs: int | None = None) -> "Evidence":
        """``epochs``: the job's."""
        started, cold, warm_up, ended, killed = {}, [], None, 0, 0
        standby_t0, first, unready, trained = {}, {}, [], []
        since, gaps, last_kill = None, [], None  # since: the session's start, then each kill
        commits: dict = {}  # attempt -> [(ts, epoch)] of its committed checkpoints
        spe = None
        for e in events:
            name = e.get("event")
            if name == Event.CHECKPOINT_COMMITTED and e.get("epoch") is not None \
                    and e.get("ts") is not None:
                at = float(e["epoch"]) + (min(e.get("batch") or 0, spe) / spe if spe else 0.0)
                commits.setdefault(e.get("attempt"), []).append((e["ts"], at))
            elif name == Event.WORKER_READY and e.get("steps_per_epoch"):
                spe = int(e["steps_per_epoch"])
            if name in (Event.RUN_STARTED, Event.RUN_RESUMED):
                since = e.get("ts")
            elif name == Event.ATTEMPT_STARTED:
                started[e.get("attempt")] = e
            elif name == Event.FIRST_STEP:
                first[e.get("attempt")] = e.get("ts")
                a = started.get(e.get("attempt")) or {}
                if a.get("path", "cold") == "cold" and e.get("since_start_s") is not None:
                    cold.append(float(e["since_start_s"]))
            elif name == Event.ATTEMPT_ENDED and e.get("kind"):
                ended += 1
                killed += bool(is_kill(e["kind"]))
                t0 = first.get(e.get("attempt"))
                if is_kill(e["kind"]) and e.get("ts") is not None:
                    if t0 is not None:
                        trained.append(round(e["ts"] - t0, 3))
                    if since is not None:
                        gaps.append(round(e["ts"] - since, 3))
                    since = last_kill = e["ts"]
            elif name == Event.STANDBY_STARTED:
                standby_t0[e.get("pid")] = e.get("ts")
            elif name == Event.STANDBY_READY and standby_t0.get(e.get("pid")) is not None:
                warm_up = round(e["ts"] - standby_t0[e["pid"]], 3)
                unready = []
            elif name == Event.STANDBY_DISCARDED and e.get("was_alive") and not _was_ready(e):
                unready.append(float(e.get("age_s") or 0.0))
            elif name == Event.STANDBY_PROMOTED and e.get("adopted"):
                unready.append(float(e.get("age_s") or 0.0))  # adopted before it was ready
        newest = max((c for cs in commits.values() for c in cs), default=None)
        sized = [e for e in events if e.get("event") == Event.CHECKPOINT_COMMITTED
                 and e.get("state_bytes") is not None]
        state = max(sized, key=lambda e: e.get("step") or 0)["state_bytes"] if sized else None
        paces = [(cs[-1][1] - cs[0][1]) / (cs[-1][0] - cs[0][0]) for cs in commits.values()
                 if len(cs) >= 2 and cs[-1][0] > cs[0][0] and cs[-1][1] > cs[0][1]]
        return cls(ended, killed, statistics.median(cold) if cold else None, warm_up,
                   tuple(unready), tuple(trained), tuple(gaps), last_kill,
                   epoch=newest[1] if newest else None, epochs=epochs,
                   epochs_per_s=statistics.median(paces) if paces else None, state_bytes=state)


def _was_ready(discarded: dict) -> bool:
    """A discarded standby had warmed up (journals older than ``was_ready`` say it in words)."""
    if "was_ready" in discarded:
        return bool(discarded["was_ready"])
    return "warming up" not in (discarded.get("reason") or "")


def memory_allows(worker_rss: int | None, headroom: int | None,
                  state_bytes: int | None = None) -> tuple[bool, str]:
    """Whether the memory left could hold a standby: it holds about as much as the worker
    (ResNet-20 on 2 cores: 939 MiB ready, beside the worker's peak of 1027 MiB), so it needs
    the worker's resident size x ``MEMORY_MARGIN``; and one more copy of the state
    (``state_bytes``, the newest checkpoint's): a promoted standby reads the checkpoint into host
    arrays beside its model's, and the worker's own grows by a host copy of the state at each
    capture, which a heartbeat between captures does not show (issue 37: a 1.2 GB state, the
    worker's peak 5.0 GiB against plain fit's 2.9). Unknown figures allow it."""
    if headroom is None or not (worker_rss or state_bytes):
        return True, "memory: not known"
    need = (worker_rss or 0) * MEMORY_MARGIN + (state_bytes or 0)
    why = (f"{headroom / 2**30:.1f} GiB of memory available, a standby needs about "
           f"{need / 2**30:.1f} GiB (the worker's {(worker_rss or 0) / 2**30:.1f} GiB x "
           f"{MEMORY_MARGIN}" + (f" + the state's {state_bytes / 2**30:.1f} GiB"
                                  if state_bytes else "") + ")")
    return headroom >= need, why


def cores() -> int:
    """The cores this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worth_it(strategy: str, n_cores: int, ev: Evidence,
             now: float | None = None) -> tuple[bool, str]:
    """``auto``'s answer for one attempt on ``strategy`` (tpu|gpu|cpu), with why in numbers;
    ``now``: the time a standby would start (its worker's start-up done)."""
    if strategy in ("gpu", "tpu"):
        return True, f"the worker trains on the {strategy.upper()}: the CPU is spare"
    if n_cores >= SPARE_CORES:
        return True, f"{n_cores} cores: one is the standby's while it warms up"
    # until a standby here was ready, its warm-up is taken to be as long as a cold start (the
    # same imports, build and trace); what it costs the worker beside it
    warm_up = ev.warm_up_s or ev.cold_start_s or DEFAULT_WARM_UP_S
    cost = warm_up * WARM_UP_SLOWDOWN * 2 / n_cores
    if not ev.killed:
        left = ev.training_left_s()
        if left is not None and cost <= LONG_RUN_SHARE * left:
            return True, (f"no kill in this run yet, and {left:.0f} s of training left: a "
                          f"warm-up costs it ~{cost:.1f} s ({warm_up:.1f} s x "
                          f"{WARM_UP_SLOWDOWN} x 2/{n_cores}), {cost / left:.1%} of that, "
                          f"at most {LONG_RUN_SHARE:.0%}")
        return False, (f"no kill in this run yet: on {n_cores} core(s) a standby's warm-up "
                       f"slows a CPU-bound worker ({1 / (1 - WARM_UP_SLOWDOWN):.1f}x for its ~"
                       f"{ev.warm_up_s or DEFAULT_WARM_UP_S:.0f} s, measured) for no gain")
    if len(ev.unready_s) >= UNREADY_IN_A_ROW:
        # Kills that come before a standby is ready make it all cost: measured (bench --quick,
        # goodput, 2 cores, kills every ~20 s): 7 standbys of 7 discarded warming up, goodput
        # 0.20 against 0.25 with none. Tried again once attempts train longer than that.
        need = max(ev.unready_s)
        recent = statistics.median(ev.trained_s[-3:]) if ev.trained_s else 0.0
        if recent <= need:
            return False, (f"the last {len(ev.unready_s)} standbys were discarded still warming "
                           f"up (after up to {need:.1f} s), and attempts are killed "
                           f"{recent:.1f} s after their first step (median of the last "
                           f"{min(len(ev.trained_s), 3)}): a standby would not be ready in time")
    if ev.kill_gaps_s and ev.last_kill_ts is not None and now is not None:
        gap = statistics.median(ev.kill_gaps_s[-3:])
        left = gap - (now - ev.last_kill_ts)
        ready_in = max((warm_up, *ev.unready_s))  # at least as long as those unready had run
        every = (f"kills come every {gap:.1f} s (median of the last "
                 f"{min(len(ev.kill_gaps_s), 3)}), the last {now - ev.last_kill_ts:.1f} s ago")
        if left <= ready_in:
            return False, (f"{every}: the next is expected in {left:.1f} s, before a standby "
                           f"would be ready ({ready_in:.1f} s warm-up)")
        training_left = ev.training_left_s()
        if training_left is not None and training_left <= left:
            # measured (bench --quick, goodput, 2026-12-05): the one started after the run's
            # only kill was never used (the run ended first), and it cost auto 0.538 goodput
            # against 0.572 with none
            return False, (f"{every}: the run is expected to end in {training_left:.1f} s "
                           f"({ev.epochs - ev.epoch:.1f} epochs at {ev.epochs_per_s:.2f}/s), "
                           f"before the next kill (in {left:.1f} s)")
    share = ev.killed / max(ev.attempts_ended, 1)
    cold = ev.cold_start_s or DEFAULT_COLD_START_S
    gain = share * cold
    figures = (f"{ev.killed} of {ev.attempts_ended} attempts killed x {cold:.1f} s cold start "
               f"= {gain:.1f} s expected saved, against {warm_up:.1f} s warm-up x "
               f"{WARM_UP_SLOWDOWN} x 2/{n_cores} = {cost:.1f} s of training lost")
    return gain > cost, figures
