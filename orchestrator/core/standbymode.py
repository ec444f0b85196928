"""The standby's modes, defined once: the job's ``standby:`` setting (read by the spec), the mode
the supervisor starts a standby worker in (``--standby MODE``, supervise/standby.py) and the mode
that worker prepares for and journals (train/standby.py, train/worker.py). Plain strings in the
job file, on the command line and in the journal.
"""
from __future__ import annotations


class StandbyMode:
    AUTO = "auto"                # the job's setting: where allowed and worth it (standby_policy)
    ON = "on"                    # the job's setting: wherever the device allows one
    OFF = "off"                  # the job's setting: never a standby
    IMPORT_ONLY = "import_only"  # imported the framework only (a TPU the active worker holds)
    WARM = "warm"                # imported, built, compiled, traced
    ADOPTED = "adopted"          # a recovery's path: a standby promoted while warming up

    #: what a job's ``standby:`` may say
    SETTINGS = (AUTO, ON, OFF, IMPORT_ONLY)
    #: what a standby process is started as
    STARTED = (WARM, IMPORT_ONLY)
