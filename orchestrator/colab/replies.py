"""What the Colab CLI's output means, read from what its source prints (google-colab-cli,
``colab_cli/``; the lines quoted below are its own).

- ``new`` prints ``[colab] Creating session 'NAME'...`` then ``[colab] Session READY.`` and
  exits 0. Refused: a 400 for an accelerator prints ``[colab] Backend rejected accelerator
  'T4'. You may not have quota or entitlement ...`` and exits 1; a 412 raises
  ``TooManyAssignmentsError``; any other HTTP error raises ``ColabRequestError: Failed to issue
  request GET URL: REASON`` (a traceback, exit 1; its last line is that one).
- A sign-in the CLI cannot do alone: OAuth2 prints ``To authorize colab-cli, visit this URL in
  any browser:`` and reads a code from standard input (which we close: EOFError, exit 1); ADC
  prints ``No valid default credentials found. To authenticate, run:`` and the gcloud command
  (exit 1), or with no ADC at all raises ``DefaultCredentialsError``; a refresh token revoked
  raises ``RefreshError`` (``invalid_grant``). Seen with the released CLI (0.7.5): ``new``
  with no token prints ``Enter the authorization code:`` on stdout, the URL on stderr, then
  ``Aborted.``, exit 1.
- ``status -s NAME`` lists ``[NAME] ENDPOINT | Hardware: X | Variant: Y | Status: IDLE`` for a
  live session, after dropping those the backend no longer has; a gone one prints ``[colab]
  Session 'NAME' not found.`` - with exit status 0.
- ``exec`` exits 0 even when the code raised (the traceback goes to stderr): our code reports
  through a marker line (``MARK``) on stdout, and no marker means it did not run to the end. A
  session the backend lost prints ``[colab] Session 'NAME' appears to be lost (404/401).
  Cleaning up.`` (exit 1).
- ``install`` prints ``Installation Complete (via uv)!`` or ``(via pip)!`` and exits 0 even when
  pip failed (its error goes to stderr).
- ``drivemount`` needing the user's consent prints ``REQUIRED: Google Drive Authorization
  needed.`` and waits on /dev/tty (which our calls have none of).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orchestrator.colab.colabcli import Reply

MARK = "@@orchestrator-colab "

# reasons a runtime was refused (the journal's runtime_refused ``reason``)
CAPACITY = "capacity"
USAGE_LIMIT = "usage_limit"
TOO_MANY = "too_many_sessions"
ERROR = "error"

_LOGIN = ("To authorize colab-cli, visit this URL", "Enter the authorization code",
          "No valid default credentials found", "DefaultCredentialsError", "RefreshError",
          "invalid_grant")
_CAPACITY_REASONS = re.compile(r"Too Many Requests|Service Unavailable|Resource Exhausted|"
                               r"Insufficient|\b(429|503)\b", re.I)


@dataclass
class Allocated:
    pass


@dataclass
class Refused:
    reason: str   # CAPACITY, USAGE_LIMIT, TOO_MANY or ERROR
    line: str     # the CLI's own words, one line


@dataclass
class LoginExpired:
    line: str     # what the user must run


def login_expired(reply: Reply) -> LoginExpired | None:
    """The sign-in the CLI needs a person for, and what to tell them; None when it is not."""
    text = reply.text
    if reply.rc == 0 or not any(m in text for m in _LOGIN):
        return None
    gcloud = re.search(r"gcloud auth application-default login[^\n]*(\n\s+--scopes=\S+)?", text)
    if gcloud:
        cmd = " ".join(gcloud.group(0).replace("\\", " ").split())
        return LoginExpired(f"the Colab CLI's login (ADC) has expired: run `{cmd}`, then run "
                            f"this command again")
    return LoginExpired("the Colab CLI's login has expired: run `colab sessions` in a terminal, "
                        "open the link it prints, paste the code back, then run this command "
                        "again")


def new_outcome(reply: Reply) -> Allocated | Refused | LoginExpired:
    """What ``colab new`` did."""
    if reply.rc == 0 and "Session READY." in reply.out:
        return Allocated()
    expired = login_expired(reply)
    if expired is not None:
        return expired
    text = reply.text
    if reply.timed_out:
        return Refused(ERROR, f"`colab new` gave no answer within its time ({last_line(text)})")
    if "Backend rejected accelerator" in text:
        return Refused(USAGE_LIMIT, line_with(text, "Backend rejected accelerator"))
    raised = exception_line(text)
    if "TooManyAssignmentsError" in raised:
        return Refused(TOO_MANY, raised)
    if "Failed to issue request" in raised and _CAPACITY_REASONS.search(raised):
        return Refused(CAPACITY, raised)
    return Refused(ERROR, raised or last_line(text) or f"exit status {reply.rc}")


def session_gone(reply: Reply, session: str) -> bool:
    """The CLI says the session is no more (``status`` or ``exec``)."""
    if reply.timed_out:
        return False
    if f"[{session}] " in reply.out and "Status:" in reply.out:
        return False
    return any(f"[colab] Session '{session}' {m}" in reply.text
               for m in ("not found.", "appears to be lost"))


def marked(reply: Reply) -> dict | None:
    """The last marker our code printed in the runtime (``exec``), or None when it printed
    none (it did not run, or raised before the end)."""
    found = None
    for line in reply.out.splitlines():
        if line.startswith(MARK):
            try:
                found = json.loads(line[len(MARK):])
            except json.JSONDecodeError:
                continue
    return found


def installed(reply: Reply) -> bool:
    return reply.rc == 0 and "Installation Complete" in reply.out


def drive_needs_consent(reply: Reply) -> bool:
    return "Google Drive Authorization needed" in reply.text


def exception_line(text: str) -> str:
    """The last ``module.Error: message`` line of a traceback (the CLI's are plain Python
    tracebacks: we set typer's ``_TYPER_STANDARD_TRACEBACK``, colabcli.py), or ""."""
    found = ""
    for ln in text.splitlines():
        if re.match(r"^[\w.]*(Error|Exception)\b[^ ]*:", ln):
            found = ln.strip()
    return found


def line_with(text: str, needle: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if needle in ln), "")


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
