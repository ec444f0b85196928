"""``orchestrator diagnose``: what a pasted log or traceback is, and what the policy would do.

It consults every evidence layer (recovery/failures.py ``LAYERS``) and says which one decided and
what it matched; when layers disagree (a GCS ``Unavailable:`` is storage to the signatures and a
lost accelerator to the gRPC layer) it lists every candidate, the deciding one first.
"""
from __future__ import annotations

from orchestrator.recovery import evidence, failures
from orchestrator.recovery.evidence import JobContext, Source
from orchestrator.recovery.policy import RecoveryPolicy
from orchestrator.core.spec import JobSpec, RecoverySpec
from orchestrator.core.kinds import Action, Kind


def diagnose(text: str, spec: JobSpec | None = None, layers=failures.LAYERS) -> dict:
    """Classify ``text`` (a log, a traceback, a gRPC status) and name the first action."""
    job = JobContext.from_spec(spec) if spec else None
    verdict = evidence.consult([Source("text", text, text)], job, layers, exhaustive=True)
    f = verdict.decided
    kind = f.kind if f else Kind.UNKNOWN
    recovery = spec.recovery if spec else RecoverySpec()
    policy = RecoveryPolicy(recovery, spec.restarts.max if spec else 3,
                            applicable=lambda action: _static_applicable(recovery, action))
    sig = f.signature if f else None
    return {
        "kind": kind,
        "action": policy.first_action(kind),
        "plan": plan(kind, policy, recovery),
        "signature": sig.id if sig else None,
        "evidence": f.evidence if f else None,
        "source": sig.source if sig else None,
        "layer": f.layer if f else None,
        "matched": f.matched if f else None,
        "conflict": verdict.conflict,
        "candidates": _distinct(verdict.candidates),
    }


# What each action does to the runtime, in the words a user reads in ``diagnose``.
DOES = {
    Action.RESTART: "a fresh worker process: the failed one's exit releases the accelerator "
                    "(libtpu's hold on the TPU, the CUDA context)",
    Action.REINIT_ACCELERATOR: "re-initialise the accelerator: TensorFlow shuts the TPU system "
                               "down and initialises it again; on JAX a fresh process with "
                               "libtpu's stale lock file cleared",
    Action.REINSTALL_TENSORFLOW: "reinstall the framework (tensorflow, or jax/jaxlib/libtpu)",
    Action.FALLBACK_STRATEGY: "fall back to the next strategy (tpu -> gpu -> cpu)",
    Action.WAIT_ACCELERATOR: "wait for the accelerator, probing it with backoff, and retry",
    Action.HALVE_BATCH: "halve the per-replica batch",
    Action.GIVE_UP: "stop: the run fails with the evidence",
}
# After the ladder: what the outer loop does (colab/loop.py) when the run failed of this kind.
OUTER = {Kind.ACCELERATOR_CONTEXT: "under `orchestrator colab`: a new runtime, where the run "
                                   "resumes from its last checkpoint on Drive"}


def plan(kind: str, policy: RecoveryPolicy, recovery: RecoverySpec) -> list[str]:
    """The kind's ladder in the order the supervisor climbs it, each rung with what it does
    (or why it is skipped), then what happens once the ladder is spent."""
    steps = []
    for rung in policy.ladder(kind):
        why_not = _static_applicable(recovery, rung.action)
        times = "" if rung.times == 1 else (" (as long as the budget lasts)" if rung.times is None
                                            else f" (up to {rung.times} times)")
        steps.append(f"{rung.action}: " + (f"skipped, {why_not}" if why_not
                                           else DOES[rung.action] + times))
    steps.append(f"{Action.GIVE_UP}: {DOES[Action.GIVE_UP]}")
    if kind in OUTER:
        steps.append(OUTER[kind])
    return steps


def _distinct(candidates) -> list[dict]:
    """The ranked candidates, one per layer and thing matched (a log repeats its lines)."""
    out, seen = [], set()
    for c in candidates:
        if (c.layer, c.kind, c.matched) not in seen:
            seen.add((c.layer, c.kind, c.matched))
            out.append(c.as_dict() | {"rank": len(out) + 1})
    return out


def _static_applicable(r: RecoverySpec, action: str) -> str | None:
    """The spec's opt-ins only (no run state here)."""
    opt_in = {Action.REINSTALL_TENSORFLOW: r.reinstall_tensorflow, Action.HALVE_BATCH: r.halve_batch,
              Action.FALLBACK_STRATEGY: r.strategy_fallback}
    return None if opt_in.get(action, True) else "not enabled"
