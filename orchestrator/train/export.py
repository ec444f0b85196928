"""Export a run's model for inference: ``python -m orchestrator.train.export RUN_DIR [--out DIR]``.

Worker side (imports TensorFlow). At the end of a run the worker exports the model it trained
(on the CPU with no strategy: ``at_end`` calls ``write``); otherwise, or when
that failed, the supervisor runs this module as its own process, as ``orchestrator export``
does. That builds the job's model (``jobcode``) with no distribution strategy on the CPU and
restores the newest checkpoint that verifies (either tier). Either way the weights fingerprint
is checked against the checkpoint's manifest, and the files are written under a temporary name
then renamed into place:
``model.keras`` (architecture + weights + optimizer), ``model.weights.h5`` (weights only, for
the job's own ``build_model``), ``saved_model/`` (Keras ``model.export``: a standalone
SavedModel with a ``serve`` endpoint whose batch dimension is free) and ``export.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import time

from orchestrator.checkpoint import tiers
from orchestrator.core import logs
from orchestrator.core.events import Event
from orchestrator.core.heartbeat import Phase
from orchestrator.core.osutil import read_json, sha256_file, write_json_atomic
from orchestrator.core.rundir import EXIT_CONFIG, RunDir, export_staging, export_trash
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load
from orchestrator.train import backends, datasets, jobcode, state
from orchestrator.train.errors import JobError

log = logging.getLogger("orchestrator.train.export")  # its name as __main__ too (python -m)


class ExportError(Exception):
    """Nothing can be exported (no run, no valid checkpoint, a model that differs)."""


def export(run_dir: str, out: str | None = None) -> dict:
    layout = RunDir(os.path.abspath(run_dir))
    info = read_json(layout.run_info)
    if not info:
        raise ExportError(f"{layout.root}: not a run directory (no run.json)")
    spec = load(layout.job_copy, run_dir=layout.root, backend=info.get("backend"))
    spec = dataclasses.replace(spec, job_dir=os.path.dirname(info.get("job_path")
                                                             or layout.job_copy))
    latest, arrays = tiers.for_spec(spec).latest_read(
        on_skip=lambda c, why: log.info(f"skipped {c.path}: {why}"))
    if latest is None:
        raise ExportError(f"{layout.root}: no checkpoint verifies; nothing to export")

    jobcode.import_framework(spec)
    model = jobcode.resolve(spec, spec.model, "model")()
    jobcode.compile_model(model, spec)
    if not model.built and _has_call(model):
        x = datasets.unpack(datasets.sample_batch(jobcode.load_data(spec), 2))[0]
        model(x, training=False)
    if model.optimizer is not None:
        model.optimizer.build(model.trainable_variables)
    state.restore(model, arrays, latest.manifest.get("holders"))
    return write(model, spec, latest, out or layout.export)


def at_end(spec, layout: RunDir, store, model, journal, heart, attempt,
                   injector) -> None:
    """Export the model just trained when the run is complete, saving the exporter process's
    TensorFlow import and model build (seconds, at the end of every run). Only for a model
    trained on the CPU with no distribution strategy, which is what the exporter process would
    build; otherwise (TPU, GPU, replicas), and when this fails, the supervisor runs the
    exporter process (it sees no export of the final weights)."""
    if not spec.export.at_end:
        return
    final = store.latest_valid()
    if final is None or not final.ends_run(spec.epochs):
        return
    injector.at_export()
    t0 = time.time()
    try:
        with heart.beating(phase=Phase.EXPORTING, epoch=final.epoch, step=final.step):
            write(model, spec, final, layout.export)
    except Exception as exc:  # noqa: BLE001 - the run is done; the supervisor's exporter retries
        log.info(f"export failed, the supervisor will retry it in its own process: "
                 f"{type(exc).__name__}: {exc}", extra={"tag": "worker"})  # the worker's line
        journal.append(Event.EXPORT_FAILED, source="worker", attempt=attempt, error=str(exc))
        return
    journal.append(Event.EXPORTED, source="worker", attempt=attempt, path=layout.export,
                   step=final.step, seconds=round(time.time() - t0, 3))


def write(model, spec, checkpoint, out: str) -> dict:
    """Write ``model`` (restored from, or trained to, ``checkpoint``) for inference into ``out``.

    Refuses a model whose weights are not the checkpoint's (by the manifest's fingerprint): the
    export must be exactly what the run committed. The worker calls this at the end of a run with
    the model it trained, which saves the separate process's TensorFlow import and model build.
    """
    import keras

    fp = state.fingerprint(model)
    if checkpoint.manifest.get("weights_sha256") not in (None, fp):
        raise ExportError(f"{checkpoint.path}: the model's weights do not match the manifest's "
                          f"fingerprint; refusing to export them")
    final = os.path.abspath(out)
    tmp = export_staging(final)
    os.makedirs(tmp)
    try:
        if not model.built and not _has_call(model) and all(
                layer.built for layer in model._flatten_layers(include_self=False)):
            # no forward pass to build it by: built is what its sub-models are (Keras's own
            # default build() records just that), and save_weights asks for it
            model.built = True
        backend = backends.current()
        with backend.saving():
            model.save_weights(os.path.join(tmp, "model.weights.h5"))
        files = ["model.weights.h5"]
        why_not = backend.can_export_saved_model() if spec.export.saved_model \
            else "the job's export.saved_model is false"
        keras_file = _NO_CALL
        if _callable(model):
            with backend.saving():
                keras_file = _attempt(lambda: model.save(os.path.join(tmp, "model.keras")),
                                      "model.keras")
            if keras_file == "model.keras":
                files.append(keras_file)
        else:
            why_not = why_not or _NO_CALL
        if keras_file != "model.keras":
            log.info(f"no model.keras: {keras_file}")
        if why_not is None:
            why_not = _attempt(lambda: model.export(os.path.join(tmp, "saved_model"),
                                                    format="tf_saved_model", verbose=False),
                               None)
            if why_not is not None:
                shutil.rmtree(os.path.join(tmp, "saved_model"), ignore_errors=True)
        if why_not is not None:
            log.info(f"no saved_model/: {why_not}; {', '.join(sorted(files))} "
                     f"written")
        facts = {
            "run": spec.name, "step": checkpoint.step, "epoch": checkpoint.epoch,
            "checkpoint": checkpoint.path, "weights_sha256": fp,
            "training_hash": spec.training_hash(), "exported_at": round(time.time(), 3),
            "keras": keras.__version__, "backend": keras.backend.backend(),
            "saved_model": why_not or "saved_model/", "model_keras": keras_file,
            "inputs": [{"shape": list(t.shape), "dtype": str(t.dtype)}
                       for t in (getattr(model, "inputs", None) or [])],
            "files": {n: {"sha256": sha256_file(os.path.join(tmp, n))} for n in sorted(files)},
        }
        write_json_atomic(os.path.join(tmp, "export.json"), facts)
        _into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(facts, path=final)


def _into_place(tmp: str, final: str) -> None:
    """``tmp`` renamed to ``final``; an earlier export there is moved aside and removed."""
    if os.path.exists(final):
        trash = export_trash(final)
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)


_NO_CALL = ("the model defines no call() (a GAN or VAE driven by its own train_step): only its "
            "weights are exported; load them into the job's build_model")


def _attempt(write, done):
    """``done`` when ``write()`` succeeds, else why it failed, for ``export.json``: a
    subclassed model (a GAN, a VAE) may have no config Keras can save, and its weights are
    still the run's result; the export says which files it has and why not the others."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - recorded in export.json: the weights are written
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"Keras could not write it ({type(exc).__name__}: {first})"
    return done


def _has_call(model) -> bool:
    """Whether the model has a forward pass of its own: a model that only holds sub-models for
    its custom ``train_step`` (keras-io's GAN) has none."""
    import keras

    return type(model).call is not keras.Model.call


def _callable(model) -> bool:
    """Whether there is a forward pass to save and serve (``model.keras`` and a SavedModel
    need one): a ``call`` of its own, and a model built by it."""
    return _has_call(model) and bool(getattr(model, "inputs", None) or model.built)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.train.export")
    p.add_argument("run_dir")
    p.add_argument("--out")
    args = p.parse_args(argv)
    logs.configure()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # an export for any device: built on the CPU
    try:
        facts = export(args.run_dir, args.out)
    except (ExportError, SpecError, JobError) as exc:
        log.warning(str(exc))
        return EXIT_CONFIG
    written = ", ".join(sorted(facts["files"])) + (
        ", saved_model/" if facts["saved_model"] == "saved_model/" else "")
    log.info(f"epoch {facts['epoch']} (step {facts['step']}, weights sha256 "
             f"{facts['weights_sha256']}) -> {facts['path']}: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
