# Sourced by scripts/demo and scripts/test: create or reuse .venv with the package and the extras
# the caller runs (EXTRAS, set before sourcing: the demo needs only `cpu`, the tests `cpu,test`).
# Reinstalls only when pyproject.toml changed or an extra is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ORCHESTRATOR_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-cpu}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# The stamp: pyproject.toml's hash, then the extras installed with it (one per line).
STAMP="$VENV/.orchestrator-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
installed() {  # true when the stamp is for this pyproject.toml and names extra $1
  [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$WANT" ] && tail -n +2 "$STAMP" | grep -qx "$1"
}
MISSING=""
for extra in ${EXTRAS//,/ }; do
  installed "$extra" || MISSING="yes"
done
if [ -n "$MISSING" ]; then
  echo "[setup] installing orchestrator[$EXTRAS] into $VENV (about a minute the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  if [[ ",$EXTRAS," == *",test,"* ]]; then
    # jobs/lora's KerasHub backbone: with its dependencies keras-hub pulls tensorflow-text and
    # the full tensorflow over tensorflow-cpu, so it comes without them (it imports without).
    "$VENV/bin/python" -m pip install -q --no-deps "keras-hub==0.32.0" regex tokenizers
  fi
  KEEP=""
  if [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$WANT" ]; then
    KEEP="$(tail -n +2 "$STAMP")"
  fi
  { echo "$WANT"; { [ -n "$KEEP" ] && echo "$KEEP"; echo "${EXTRAS//,/$'\n'}"; } | sort -u; } \
    > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
