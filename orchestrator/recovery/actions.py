"""Carrying out recovery actions, and what they change for the next worker attempts.

policy.py decides; this module does: it keeps the overrides the actions set (halved batch,
fallen-back strategy, reinitialise once, reinstalls done), says which actions can apply now,
runs the waits and the reinstall (of the run's backend: TensorFlow, or jax/jaxlib/libtpu), and
turns the overrides into the next worker's environment. Reinitialising the accelerator is the
worker's on TensorFlow (it shuts the TPU system down first) and the supervisor's on JAX (a
stale libtpu lock file cleared, core/tpuvm.py).
The overrides are rebuilt from the journal's ``recovery`` events, so they outlive a supervisor.
Which actions apply is read from state only (what the last worker ran on, what the last probe
saw): the policy asks while deciding, and a decision never waits on a probe.
Supervisor side: never imports TensorFlow.
"""
from __future__ import annotations

import logging
from typing import Callable

from orchestrator.core import tpuvm
from orchestrator.core.backends import JAX
from orchestrator.recovery import probes
from orchestrator.recovery.policy import Decision, next_strategy
from orchestrator.recovery.reinstall import reinstall
from orchestrator.core.rundir import ENV_BATCH_SIZE, ENV_REINIT, ENV_STRATEGY
from orchestrator.core.spec import JobSpec
from orchestrator.core.events import Event
from orchestrator.core.kinds import Action

log = logging.getLogger(__name__)


class Remedies:
    def __init__(self, spec: JobSpec, base_env: Callable[[], dict],
                 own_pgid: Callable[[], int | None], sleep: Callable[[float], None]):
        self.spec, self.base_env, self.own_pgid = spec, base_env, own_pgid
        self.sleep = sleep
        self.batch_size, self.strategy = spec.batch_size, None
        self._reinit_next = False
        self.reinstalls = 0
        self._ran_on: str | None = None  # tpu|gpu|cpu of the last worker that got ready
        self._seen: str | None = None    # the accelerator the last probe saw

    def recall(self, events: list[dict]) -> None:
        """Recovery actions of earlier sessions still hold (halved batch, fallen-back strategy)."""
        for e in events:
            if e["event"] == Event.RECOVERY:
                self.batch_size = e.get("batch_size") or self.batch_size
                self.strategy = e.get("strategy") or self.strategy
                self.reinstalls += e.get("action") == Action.REINSTALL_TENSORFLOW
            elif e["event"] == Event.WORKER_READY and e.get("strategy_kind"):
                self._ran_on = e["strategy_kind"]

    def ran_on(self, strategy: str | None) -> None:
        """What the last worker got ready on (its ``worker_ready`` event), if it did."""
        self._ran_on = strategy or self._ran_on

    @property
    def seen(self) -> str | None:
        """The accelerator the last probe saw (tpu_node | tpu_vm | gpu | cpu)."""
        return self._seen

    def probed(self, result: probes.ProbeResult) -> None:
        """What the last accelerator probe saw (the supervisor probes before each attempt)."""
        self._seen = result.accelerator

    def probe(self) -> Callable[[], probes.ProbeResult]:
        """The probe for the accelerator the next (or current) attempt runs on."""
        return probes.for_strategy(self.strategy or self.spec.strategy, self.base_env(),
                                   own_pgid=self.own_pgid)

    def worker_env(self, env: dict, consume: bool = False) -> dict:
        """``env`` with the overrides for the next attempt. ``consume``: this env starts that
        attempt, so a one-shot override (reinitialise the accelerator) is used up."""
        for key in (ENV_STRATEGY, ENV_BATCH_SIZE, ENV_REINIT):
            env.pop(key, None)
        if self.strategy:
            env[ENV_STRATEGY] = self.strategy
        if self.batch_size != self.spec.batch_size:
            env[ENV_BATCH_SIZE] = str(self.batch_size)
        if self._reinit_next:
            env[ENV_REINIT] = "1"
            self._reinit_next = not consume
        return env

    def applicable(self, action: str) -> str | None:
        """None when ``action`` can be taken now, else why not (the policy skips the rung)."""
        r = self.spec.recovery
        if action == Action.REINSTALL_TENSORFLOW:
            if not r.reinstall_tensorflow:
                return "not enabled (recovery.reinstall_tensorflow: false)"
            if self.reinstalls >= r.reinstall_max:
                return f"done {self.reinstalls} time(s) this run (recovery.reinstall_max)"
        if action == Action.HALVE_BATCH:
            if not r.halve_batch:
                return "not enabled (recovery.halve_batch: false)"
            if self.batch_size // 2 < r.min_batch_size:
                return f"batch {self.batch_size} is at the minimum"
        if action == Action.FALLBACK_STRATEGY:
            if not r.strategy_fallback:
                return "not enabled (recovery.strategy_fallback: false)"
            if next_strategy(self.current_strategy()) is None:
                return f"nothing below {self.current_strategy()}"
        return None

    def current_strategy(self) -> str:
        if self.strategy:
            return self.strategy
        if self.spec.strategy != "auto":
            return self.spec.strategy
        if self._ran_on:
            return self._ran_on
        seen = self._seen or "cpu"
        return "tpu" if seen.startswith("tpu") else seen

    def apply(self, d: Decision, env: dict) -> tuple[str, dict]:
        """Carry out ``d`` before the next attempt; returns (detail, extra journal fields)."""
        if d.action == Action.REINIT_ACCELERATOR:
            if self.spec.backend == JAX:
                # a new JAX process is a fresh TPU context; what can outlive a worker is
                # libtpu's lock file, which goes only when no process holds it
                detail, records = tpuvm.clear_stale_locks()
                return (f"the next attempt is a fresh JAX process; libtpu lock: {detail}",
                        {"libtpu_lock": records})
            self._reinit_next = True
            return "the next attempt shuts down and initialises the accelerator system", {}
        if d.action == Action.HALVE_BATCH:
            old = self.batch_size
            self.batch_size = max(self.spec.recovery.min_batch_size, old // 2)
            return f"per-replica batch {old} -> {self.batch_size}", {"batch_size": self.batch_size}
        if d.action == Action.FALLBACK_STRATEGY:
            old, skipped = self.current_strategy(), []
            self.strategy = next_strategy(old)
            while self.strategy != "cpu" and not (res := self.probe()()).ok:
                skipped.append(f"{self.strategy}: {res.detail}")  # no point in a dead one
                self.strategy = next_strategy(self.strategy)
            note = f" (passed over {'; '.join(skipped)})" if skipped else ""
            return f"strategy {old} -> {self.strategy}{note}", {"strategy": self.strategy}
        if d.action == Action.WAIT_ACCELERATOR:
            r = self.spec.recovery
            res, waited, count = probes.wait_until_ok(self.probe(), r.wait_initial, r.wait_max,
                                                      r.wait_timeout, self.sleep)
            return (f"waited {waited:.1f} s, {count} probe(s): {res.accelerator} {res.state}: "
                    f"{res.detail}", {"probe": res.as_dict()})
        if d.action == Action.REINSTALL_TENSORFLOW:
            # the run's backend (resolved when the job was loaded): jax/jaxlib/libtpu on JAX
            log.info(f"reinstalling the {self.spec.backend} install (recovery.reinstall_tensorflow)")
            self.reinstalls += 1
            result = reinstall(self.spec.recovery, env, backend=self.spec.backend)
            return result["detail"], {"reinstall": result}
        return d.reason, {}  # restart: a fresh process is the remedy

