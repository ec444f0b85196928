"""``orchestrator diagnose``: what a pasted log or traceback is, and what the policy would do."""
from __future__ import annotations

from orchestrator.recovery import failures
from orchestrator.recovery.policy import RecoveryPolicy
from orchestrator.core.spec import JobSpec, RecoverySpec
from orchestrator.core.kinds import Action, Kind


def diagnose(text: str, spec: JobSpec | None = None) -> dict:
    """Classify ``text`` (a log, a traceback, a gRPC status) and name the first action."""
    m = failures.match_text(text)
    kind = m.signature.kind if m else Kind.UNKNOWN
    recovery = spec.recovery if spec else RecoverySpec()
    policy = RecoveryPolicy(recovery, spec.restarts.max if spec else 3,
                            applicable=lambda action: _static_applicable(recovery, action))
    return {
        "kind": kind,
        "action": policy.first_action(kind),
        "signature": m.signature.id if m else None,
        "evidence": m.evidence if m else None,
        "source": m.signature.source if m else None,
    }


def _static_applicable(r: RecoverySpec, action: str) -> str | None:
    """The spec's opt-ins only (no run state here)."""
    opt_in = {Action.REINSTALL_TENSORFLOW: r.reinstall_tensorflow, Action.HALVE_BATCH: r.halve_batch,
              Action.FALLBACK_STRATEGY: r.strategy_fallback}
    return None if opt_in.get(action, True) else "not enabled"
