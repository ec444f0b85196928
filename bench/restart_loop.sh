#!/usr/bin/env bash
# What users do today when a runtime may die: run the training script again until it exits 0
# (Keras BackupAndRestore resumes it at the last saved epoch). Usage: restart_loop.sh CMD...
# Waits RESTART_DELAY seconds between tries (1), gives up after MAX_RESTARTS restarts (10).
max="${MAX_RESTARTS:-10}" delay="${RESTART_DELAY:-1}" n=0
until "$@"; do
  rc=$?
  n=$((n + 1))
  if [ "$n" -gt "$max" ]; then echo "[loop] exit $rc; giving up after $max restarts" >&2; exit 1; fi
  echo "[loop] exit $rc; restart $n in ${delay}s" >&2
  sleep "$delay"
done
