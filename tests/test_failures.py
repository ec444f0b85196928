"""Failure classification: catalogue texts in the wrappers they really come in, and diagnose."""
import json
import signal
import subprocess
import sys

import pytest

from helpers import ROOT
from orchestrator.recovery import failures
from orchestrator.recovery.failures import classify, match_text

# Real texts, wrapped differently from the catalogue entries (prefixes, class paths, line
# breaks, gRPC status JSON, escaped JSON, other ids and shapes).
WRAPPED = [
    ("accelerator_context", "tpu_configure_distributed_no_kernel",
     "tensorflow.python.framework.errors_impl.NotFoundError: TPUs not found in the cluster. "
     "Failed in initialization: No OpKernel was registered to support Op\n"
     "'ConfigureDistributedTPU' used by {{node ConfigureDistributedTPU}}with these attrs: "
     "[enable_whole_mesh_compilations=false]\nRegistered devices: [CPU, XLA_CPU]"),
    ("accelerator_context", "tpu_init_fn_not_registered",
     "NotFoundError: '__inference__tpu_init_fn_1234' is neither a type of a primitive "
     "operation nor a name of a function registered in binary running on n-1a2b3c-w-0."),
    ("accelerator_context", "cudnn_failed_to_initialize",
     "tensorflow.python.framework.errors_impl.UnknownError:  Failed to get convolution "
     "algorithm. This is probably because cuDNN failed to initialize, so try looking to see "
     "if a warning log message was printed above.\n\t [[node conv2d_1/Conv2D]]"),
    ("accelerator_unavailable", "grpc_failed_to_connect",
     'UnavailableError: 2 root error(s) found.\n  (0) Unavailable: {{function_node '
     '__inference_train_function_5}} failed to connect to all addresses\nAdditional GRPC error '
     'information from remote target /job:worker/replica:0/task:0:\n:{"created":"@1.5",'
     '"description":"Failed to pick subchannel","grpc_status":14}'),
    ("accelerator_unavailable", "grpc_socket_closed",
     'E1203 10:11:12.131415 140000 rpc_util.cc:69] RPC failed with status = "UNAVAILABLE: '
     'Socket\n    closed" and grpc_error_string = "{\\"created\\":\\"@1606\\",'
     '\\"description\\":\\"Error received from peer ipv4:10.0.0.2:8470\\",'
     '\\"grpc_message\\":\\"Socket closed\\",\\"grpc_status\\":14}"'),
    ("accelerator_unavailable", "tpu_worker_preempted",
     "UnavailableError: Socket hung up. This may be due to a preemption in a connected "
     "worker or parameter server."),
    ("accelerator_unavailable", "tpu_node_deadline",
     "2024-01-01 00:00:00.000001: W tensorflow/core/distributed_runtime/rpc/grpc_remote_master"
     ".cc:157] DEADLINE_EXCEEDED: Failed to connect to remote server at address: "
     "grpc://10.95.116.154:8470. Possible reasons: - The server is not started."),
    ("accelerator_unavailable", "cuda_launch_failed",
     "2019-02-08 13:27:16.548190: E tensorflow/stream_executor/cuda/cuda_event.cc:48] Error "
     "polling for event status: failed to query event: CUDA_ERROR_LAUNCH_FAILED: unspecified "
     "launch failure\n2019-02-08 13:27:16.548251: F tensorflow/core/common_runtime/gpu/"
     "gpu_event_mgr.cc:274] Unexpected Event status: 1\nAborted (core dumped)"),
    ("accelerator_unavailable", "colab_gpu_usage_limits",
     "Cannot connect to GPU backend\nYou cannot currently connect to a GPU due to usage "
     "limits in Colab."),
    ("accelerator_busy", "libtpu_in_use",
     "I0000 00:00:1649423660.053391 1924758 f236.cc:165] libtpu.so already in use by another "
     "process probably owned by another user. Run \"$ sudo lsof -w /dev/accel0\" to figure "
     "out which process is using the TPU."),
    ("out_of_memory", "oom_allocating_tensor",
     "ResourceExhaustedError:  OOM when allocating tensor with shape[256,512,14,14] and type "
     "half on /job:worker/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc\n"
     "\t [[node model/block3/conv/Conv2D (defined at train.py:88) ]]"),
    ("storage", "drive_transport_endpoint",
     "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
     "OSError: [Errno 107] Transport endpoint is not connected: '/content/drive/MyDrive/ck'"),
    ("storage", "drive_io_error",
     "shutil.Error: [('/content/a', '/content/drive/MyDrive/a', '[Errno 5] Input/output "
     "error')]"),
    ("storage", "drive_quota_exceeded",
     "MessageError: A Google Drive quota has been exceeded. Try again later."),
    ("user_error", "tpu_name_missing",
     "  File \"/usr/local/lib/python3.10/dist-packages/tensorflow/python/distribute/"
     "cluster_resolver/tpu/tpu_cluster_resolver.py\", line 239, in __init__\n"
     "ValueError: Please provide a TPU Name to connect to."),
    ("user_error", "drive_mountpoint_not_empty",
     "ValueError: Mountpoint must not already contain files"),
    ("user_error", "jax_array_deleted",  # jax's docs on buffer donation (jax-ml/jax)
     "Traceback (most recent call last):\nRuntimeError: Array has been deleted with "
     "shape=int32[4]."),
    ("killed", "colab_ram_exhausted",
     "Your session crashed after using all available RAM. If you are interested in access to "
     "high-RAM runtimes, you may want to check out Colab Pro."),
]


@pytest.mark.parametrize("kind,sig,text", WRAPPED, ids=[w[1] for w in WRAPPED])
def test_real_texts_in_other_wrappers_are_classified(kind, sig, text):
    m = match_text(text)
    assert m is not None, text
    assert (m.signature.kind, m.signature.id) == (kind, sig)
    assert m.evidence and m.evidence in text


def test_catalogue_is_well_formed_and_every_injectable_message_classifies_back():
    sigs = failures.catalogue()
    assert len({s.id for s in sigs}) == len(sigs)
    injectable = [s for s in sigs if s.raise_]
    assert {s.kind for s in injectable} >= {"accelerator_context", "accelerator_unavailable",
                                            "accelerator_busy", "out_of_memory", "storage",
                                            "user_error"}
    for s in injectable:
        text = " ".join(str(a) for a in s.raise_["args"] if a is not None)
        assert match_text(text).signature.kind == s.kind, s.id


def test_known_warnings_are_not_failures():
    warning = ("W1203 tpu_strategy_util.py:60] TPU system grpc://10.0.0.2:8470 has already "
               "been initialized. Reinitializing the TPU can cause previously created "
               "variables on TPU to be lost.")
    assert match_text(warning) is None
    assert match_text("everything went fine\nepoch 3/10 loss 0.2") is None


def test_the_cause_at_the_end_of_a_log_wins():
    log = ("W ... Socket closed (retrying)\n... training continues ...\n"
           "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when "
           "allocating tensor with shape[8,8]")
    assert match_text(log).signature.kind == "out_of_memory"


def test_evidence_sources_in_order_of_trust():
    oom = {"type": "ResourceExhaustedError", "message": "OOM when allocating tensor"}
    assert classify(hang_s=12.5).kind == "hang"
    assert classify(-signal.SIGKILL, None, "Socket closed").kind == "killed"
    assert classify(1, {"type": "JobError", "message": "x", "fatal": True}).kind == "user_error"
    d = classify(1, oom, "")
    assert (d.kind, d.signature) == ("out_of_memory", "oom_allocating_tensor")
    assert d.evidence.startswith("ResourceExhaustedError: OOM")
    # no record: the log says it (SIGABRT after a CUDA launch failure)
    d = classify(-signal.SIGABRT, None, "F gpu_event_mgr.cc:274] Unexpected Event status: 1")
    assert d.kind == "accelerator_unavailable"
    assert classify(78, None, "").kind == "user_error"
    assert classify(137, None, "").kind == "killed"
    assert classify(1, {"type": "KeyError", "message": "'x'"}, "").kind == "unknown"
    assert classify(-signal.SIGSEGV, None, "").kind == "unknown"


def _diagnose(args, stdin=None):
    p = subprocess.run([sys.executable, "-m", "orchestrator", "diagnose", *args], input=stdin,
                       capture_output=True, text=True, cwd=ROOT)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.integration
def test_diagnose_reads_stdin_and_files_and_names_the_action(tmp_path):
    rc, out, _ = _diagnose(["-"], stdin=WRAPPED[4][2])
    assert rc == 0
    got = json.loads(out)
    assert {k: got[k] for k in ("kind", "action", "signature", "evidence", "source")} == {
        "kind": "accelerator_unavailable", "action": "wait_accelerator",
        "signature": "grpc_socket_closed", "evidence": WRAPPED[4][2].splitlines()[1].strip(),
        "source": "tensorflow#36544, tensorflow#46007"}
    assert (got["layer"], got["matched"]) == ("signatures", "signature grpc_socket_closed")
    log = tmp_path / "worker.log"
    log.write_text(WRAPPED[0][2])
    out = json.loads(_diagnose([str(log)])[1])
    assert (out["kind"], out["action"]) == ("accelerator_context", "restart")
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nmodel: m:f\ndata: m:g\nepochs: 1\nbatch_size: 4\n"
                   "recovery: {halve_batch: true}\n")
    oom = "ResourceExhaustedError: OOM when allocating tensor with shape[1]"
    assert json.loads(_diagnose(["-"], stdin=oom)[1])["action"] == "restart"
    assert json.loads(_diagnose(["-", "--job", str(job)], stdin=oom)[1])["action"] == \
        "halve_batch"
    assert json.loads(_diagnose(["-"], stdin="all good")[1])["kind"] == "unknown"


@pytest.mark.integration
def test_diagnose_knows_an_unknown_optimizer_is_the_jobs_without_the_job():
    """Keras's own sentence, and the worker's line for it, pasted without --job."""
    for text in ("ValueError: Could not interpret optimizer identifier: adamm",
                 "[worker] error: key 'compile.optimizer': Keras does not accept 'adamm' "
                 "(Could not interpret optimizer identifier: adamm); did you mean 'adam'? "
                 "Keras accepts adadelta, adafactor, adagrad, adam"):
        rc, out, err = _diagnose(["-"], stdin=text)
        assert rc == 0, err
        got = json.loads(out)
        assert (got["kind"], got["action"], got["signature"]) == (
            "user_error", "give_up", "keras_unknown_identifier"), text


@pytest.mark.integration
def test_diagnose_of_a_missing_file_is_a_clear_error(tmp_path):
    rc, out, err = _diagnose([str(tmp_path / "nope.log")])
    assert rc == 2 and "nope.log: cannot read" in err and "Traceback" not in err


def test_a_tpu_held_by_another_process_is_busy_even_inside_jax_s_backend_error():
    """JAX wraps libtpu's sentence in "Unable to initialize backend 'tpu': ..." and appends
    its advice after it: the held TPU (wait for it) must win over a broken backend."""
    held = ("RuntimeError: Unable to initialize backend 'tpu': ABORTED: The TPU is already in "
            "use by process with pid 4242. Not attempting to load libtpu.so in this process. "
            "(set JAX_PLATFORMS='' to automatically choose an available backend)")
    broken = ("RuntimeError: Unable to initialize backend 'cuda': FAILED_PRECONDITION: No "
              "visible GPU devices. (set JAX_PLATFORMS='' to automatically choose an "
              "available backend)")
    assert failures.match_text(held).signature.kind == "accelerator_busy"
    assert failures.match_text(broken).signature.kind == "accelerator_context"


# Issue 38: one family per library sentence the rule was written from, each in wrappers other
# than its catalogue text's (another generation, a jax or TF exception around it, a log line).
FAMILIES = {
    "tpu_system_init_failed": ("accelerator_context", [
        "E1203 10:11:12.000001    4242 tpu_hal.cc:251] Failed to initialize TPU system with "
        "error: FAILED_PRECONDITION: Couldn't mmap: Resource temporarily unavailable",
        "jax.errors.JaxRuntimeError: FAILED_PRECONDITION: Couldn't mmap: Operation not "
        "permitted\n=== Source Location Trace: ===\nlearning/45eac/tpu/runtime/hal/tpu_hal.cc:249"]),
    "tpu_hal_register_failed": ("accelerator_context", [
        "F0101 00:00:01.000001 1234 tpu_hal_pxc_hardware_impl_registration.cc:12] Check failed: "
        "tpu::TpuHalFactory::Register( tpu::TpuPlatformType::kHardware, tpu::TpuVersion::k1, "
        "std::make_unique<tpu::TpuHalPxcHardwareFactory>()) is OK (FAILED_PRECONDITION: TPU "
        "platform already registered\n*** Check failure stack trace: ***"]),
    "keras_unseeded_random_in_jax_trace": ("user_error", [
        "jax._src.traceback_util.UnfilteredStackTrace: ValueError: [JAX RNG] When tracing a JAX "
        "function, you should only use seeded random ops, e.g. you should create a "
        "`SeedGenerator` instance",
        "ValueError: ... Unseeded random ops would get incorrectly traced by JAX and would "
        "become constant after tracing."]),
    "keras_backup_and_restore_unbuilt": ("user_error", [
        "ValueError: To use the BackupAndRestore callback, you model must be built before you "
        "call `fit()`. Model <Sequential name=sequential, built=False> is unbuilt.",
        "ValueError: To use the BackupAndRestore method, your model must be built before you "
        "call `fit()`. Model is unbuilt."]),
    "tf_sparse_label_out_of_range": ("user_error", [
        "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n"
        "Detected at node sparse_categorical_crossentropy/SparseSoftmaxCrossEntropyWithLogits\n"
        "  (0) INVALID_ARGUMENT:  Received a label value of 10 which is outside the valid range "
        "of [0, 10).  Label values: 3 10 1 7"]),
    "tpu_grpc_driver_unreachable": ("accelerator_unavailable", [
        "E0212 08:00:00.000001: E external/xla/xla/python/tpu_driver/grpc_tpu_driver.cc:1070] "
        "Failed to open the gRPC driver: 14: Connection reset by peer",
        # jax's wrapper ends with its advice, later than the sentence: the cause still wins
        "RuntimeError: Unable to initialize backend 'tpu_driver': DEADLINE_EXCEEDED: Failed to "
        "open the gRPC driver (set JAX_PLATFORMS='' to automatically choose an available "
        "backend)"]),
}


@pytest.mark.parametrize("sig", list(FAMILIES))
def test_each_issue_38_family_is_named_from_its_library_sentence(sig):
    kind, texts = FAMILIES[sig]
    for text in texts:
        m = match_text(text)
        assert m is not None, text
        assert (m.signature.kind, m.signature.id) == (kind, sig), text
        assert classify(1, None, text).kind == kind


def test_the_tpu_rules_need_the_tpu_and_keras_needs_its_own_words():
    """'Couldn't mmap' alone is no TPU (a dataset file can fail so), nor a plain 'must be
    built' (Keras's export says it too, of another call)."""
    assert match_text("OSError: Couldn't mmap /data/train.bin: Cannot allocate memory") is None
    assert match_text("ValueError: The model must be built before export.") is None
