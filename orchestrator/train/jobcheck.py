"""The doctor's job-code probe: ``python -m orchestrator.train.jobcheck JOB --result FILE``.

``orchestrator doctor JOB`` runs on the supervisor side, which never imports TensorFlow, so it
starts this module as a process of its own. It does what a worker does before its first step,
on the CPU with no strategy and without writing anything in the run directory: import the job's
modules and resolve every factory, check the compile identifiers against Keras, load the data,
build and compile the model and run the first step's forward pass and loss on a sample batch
(``jobcode``), then the job's callbacks and learning-rate schedule. The first mistake is written
to FILE as JSON with the key at fault (``compile.optimizer``, ``model`` ...); the exit status is
0 when the job code is fine, ``EXIT_CONFIG`` for a job mistake, 1 for anything else.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

from orchestrator.core.backends import ENV_BACKEND
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import EXIT_CONFIG
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load
from orchestrator.train import holders, jobcode, tensorboard
from orchestrator.train.errors import JobError


def check(spec) -> str:
    """Every job-code check in the worker's order; returns what was built, in words."""
    if spec.tensorboard:  # before the framework's import, as the worker does
        tensorboard.require()
    backend = jobcode.import_framework(spec)

    made = jobcode.factories(spec)
    jobcode.check_compile(spec)
    data = jobcode.load_data(spec)
    model = jobcode.build_model(spec, backend.placement(spec, None, False).strategy, data)
    jobcode.schedule(spec, model.optimizer)
    callbacks = jobcode.job_callbacks(spec)
    optimizers = ", ".join(f"{g.cls}" + ("" if g.name == holders.OPTIMIZER else f" ({g.where})")
                           for g in holders.discover(model).groups
                           if g.kind == holders.OPTIMIZER) or "no optimizer"
    step = ("builds (its own train_step decides what a batch is)" if jobcode.custom_step(model)
            else "takes a batch of the {n} training examples through the first step's loss")
    # counted from the weights: count_params() refuses a model with no call() of its own to
    # build it (keras-io's GAN), which fit trains all the same
    params = sum(int(np.prod(w.shape)) for w in model.weights)
    return (f"imported {', '.join(sorted({f.target for f in made}))}; model {model.name} "
            f"({params:,} parameters, {optimizers}) "
            + step.format(n=data.num_examples)
            + (f"; {len(callbacks)} callback(s)" if callbacks else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.train.jobcheck")
    p.add_argument("job")
    p.add_argument("--result", required=True, help="write the verdict here as JSON")
    args = p.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a check of the job's code, not of the device
    t0 = time.time()
    result: dict = {"ok": False, "key": None}
    try:
        spec = load(args.job, backend=os.environ.get(ENV_BACKEND) or None)
        result.update(ok=True, detail=check(spec))
        code = 0
    except SpecError as exc:
        result.update(error=str(exc))
        code = EXIT_CONFIG
    except JobError as exc:
        result.update(error=str(exc), key=exc.key)
        code = EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - the doctor reports it; the traceback goes to stderr
        traceback.print_exc()
        result.update(error=f"{type(exc).__name__}: {exc}".strip())
        code = 1
    result["seconds"] = round(time.time() - t0, 3)
    write_json_atomic(args.result, result)
    print(f"[jobcheck] {result.get('detail') or result.get('error')}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
