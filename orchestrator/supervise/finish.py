"""The end of a run: completed (durable flush, export) or given up (the final report).

A completed run waits (up to ``checkpoint.flush_timeout``) for every checkpoint due to be
durable, journals ``run_completed`` once, and exports the final model for inference in a
separate process (it imports TensorFlow), unless the last worker exported these very weights
already. A run given up journals ``run_failed`` with the kind, the evidence and every action
tried, and says on the console where to look.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

from orchestrator.checkpoint.mirror import DurableMirror
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.kinds import Action
from orchestrator.core.osutil import read_json
from orchestrator.core.rundir import RunDir, export_leftovers
from orchestrator.core.spec import JobSpec
from orchestrator.recovery.policy import Decision
from orchestrator.supervise.attempt import Outcome

log = logging.getLogger(__name__)


class RunEnd:
    def __init__(self, spec: JobSpec, rd: RunDir, journal: Journal, mirror: DurableMirror,
                 console, export_cmd, export_env, run_dir_back=lambda timeout: True):
        """``run_dir_back(timeout)``: True once the run directory answers (the export is
        written there), waiting up to ``timeout``."""
        self.run_dir_back = run_dir_back
        self.spec, self.rd, self.journal, self.mirror = spec, rd, journal, mirror
        self.console, self.export_cmd, self.export_env = console, export_cmd, export_env

    def completed(self, final, counters: dict) -> int:
        fp = final.manifest.get("weights_sha256") if final else None
        pending = self._flush_durable()
        if not any(True for _ in self.journal.iter(Event.RUN_COMPLETED)):
            self.journal.append(Event.RUN_COMPLETED, epochs=final.epoch, weights_sha256=fp,
                                state_sha256=final.manifest.get("state_sha256"),
                                checkpoint=final.path, durable_pending=pending, **counters)
        log.info(f"run '{self.spec.name}' completed: {final.epoch} epochs, "
                 f"{counters['restarts']} restart(s) this session; weights sha256 {fp}")
        self._export(final)
        self._tidy_export()
        self._tidy_blobs()
        return 0

    def failed(self, outcome: Outcome, decision: Decision, evidence: str | None, epoch: int,
               counters: dict) -> int:
        tried = [e["action"] for e in self.journal.iter(Event.RECOVERY)
                 if e["action"] != Action.GIVE_UP]
        self.journal.append(Event.RUN_FAILED, reason=decision.reason,
                            last_attempt=outcome.attempt,
                            exit_code=outcome.exit_code if outcome.exit_code != 0 else 1,
                            error=summary(outcome.error), epoch=epoch, kind=decision.kind,
                            evidence=evidence, tried=tried, **counters)
        self.console.fault(f"FAULT {decision.kind}: {outcome.describe()} -> giving up")
        log.info(f"run '{self.spec.name}' FAILED at epoch {epoch}/{self.spec.epochs}: "
                 f"{decision.reason}")
        log.info(f"  kind: {decision.kind}; evidence: {evidence or '?'}")
        log.info(f"  tried: {', '.join(tried) or 'nothing (not retryable)'}; "
                 f"log: {outcome.log}")
        return 1

    def _flush_durable(self) -> list[int]:
        """Wait (up to checkpoint.flush_timeout) until every checkpoint due is durable."""
        timeout = self.spec.checkpoint.flush_timeout
        pending = self.mirror.flush(timeout) if self.mirror.running else \
            [c.step for c in self.mirror.backlog()]  # no mirror to wait for: what it lacks
        if pending:
            local = self.mirror.store.local.root
            self.journal.append(Event.DURABLE_BACKLOG, steps=pending, at="run_end",
                                local_dir=local)
            log.info(
                f"WARNING: {len(pending)} checkpoint(s) are not durable after {timeout:.0f} s "
                f"(steps {pending}); they are only in {local}. Run the same command again on "
                f"this machine to flush them.")
        return pending

    def _tidy_export(self) -> None:
        """Remove what an export killed half-way left beside ``export/`` (its staging folder,
        or the old export it was replacing). At the end of a completed run every worker and
        exporter of it has exited, and the lease keeps any other supervisor out: no one is
        writing them."""
        try:
            for path in export_leftovers(self.rd.export):
                shutil.rmtree(path)
                log.info(f"removed {os.path.basename(path)}/, left in the run directory by an "
                         f"export that was killed half-way")
        except OSError as exc:  # the run directory went away: the next completed run tidies
            log.info(f"could not tidy the export's leftovers in {self.rd.root}: {exc}")

    def _tidy_blobs(self) -> None:
        """Delete the blobs no kept checkpoint names, in both tiers, with no grace: retention
        keeps a blob younger than a minute (the storage's clock may differ from ours), so a
        run that checkpoints more often than that ended with the blobs of every checkpoint it
        had deleted in its last minute (measured: 7.1 GB for 2.5 GB kept, a 1.26 GB state).
        Here every worker has exited, and the lease keeps any other supervisor out."""
        for tier in (self.mirror.store.local, self.mirror.store.durable):
            try:
                removed = tier.collect_blobs(grace_s=0.0)
            except OSError as exc:  # a tier gone away: the next run's retention collects them
                log.info(f"could not remove the unused blobs of {tier.root}: {exc}")
                continue
            if removed:
                log.info(f"removed {len(removed)} blob(s) that no kept checkpoint names from "
                         f"{tier.root}")

    def _export(self, final) -> None:
        """Export the final model for inference in a separate process (it imports TF), unless
        the last worker exported these weights already, or the job asks for no export at
        the end (``export.at_end: false``: a gigabyte model written again in each format)."""
        if self.export_cmd is None or final is None:
            return
        if not self.spec.export.at_end:
            log.info(f"no export at the end (the job's export.at_end is false); "
                     f"`orchestrator export {self.rd.root}` writes one")
            return
        done = read_json(os.path.join(self.rd.export, "export.json")) or {}
        if done.get("weights_sha256") == final.manifest.get("weights_sha256"):
            log.info(f"the model for inference is in {self.rd.export}")
            return
        log_path = os.path.join(self.rd.attempts, "export.log")
        if not self.run_dir_back(self.spec.checkpoint.flush_timeout):
            self.journal.append(Event.EXPORT_FAILED, exit_code=None, log=log_path,
                                reason="the run directory is unreachable")
            log.info(f"export skipped: the run directory {self.rd.root} is unreachable; "
                     f"retry with `orchestrator export {self.rd.root}` once it is back")
            return
        t0 = time.time()
        with open(log_path, "ab") as f:
            rc = subprocess.call(self.export_cmd(self.spec), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=self.spec.job_dir,
                                 env=self.export_env())
        if rc == 0:
            self.journal.append(Event.EXPORTED, path=self.rd.export, step=final.step,
                                seconds=round(time.time() - t0, 3))
            log.info(f"exported the model for inference to {self.rd.export}")
        else:
            self.journal.append(Event.EXPORT_FAILED, exit_code=rc, log=log_path)
            log.info(f"export failed (exit code {rc}); see {log_path}; retry with "
                     f"`orchestrator export {self.rd.root}`")


def summary(error: dict | None) -> dict | None:
    if not error:
        return None
    return {k: error.get(k) for k in ("type", "message", "epoch", "batch") if k in error}
