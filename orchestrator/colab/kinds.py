"""The kinds of runtime the Colab CLI can allocate, and the flags of ``colab new`` for each.

From the CLI's source (``colab_cli/commands/session.py``, ``new``): ``--tpu`` takes v5e1 or
v6e1 (anything else but v5e1 silently becomes V6E1), ``--gpu`` takes T4, L4, G4, H100, A100
(anything else silently becomes A100), neither gives a CPU runtime. We refuse what the CLI would
silently replace, so a typo never costs a runtime of another kind.
"""
from __future__ import annotations

from dataclasses import dataclass

TPUS = ("v5e1", "v6e1")
GPUS = ("T4", "L4", "G4", "A100", "H100")


@dataclass(frozen=True)
class RuntimeKind:
    accelerator: str  # "cpu", "tpu" or "gpu"
    model: str | None = None

    @property
    def flags(self) -> list[str]:
        """``colab new``'s flags for this kind."""
        return [] if self.model is None else [f"--{self.accelerator}", self.model]

    def __str__(self) -> str:
        return self.accelerator if self.model is None else f"{self.accelerator} {self.model}"


def runtime_kind(tpu: str | None = None, gpu: str | None = None) -> RuntimeKind:
    """The kind asked for by ``--tpu``/``--gpu`` (neither: a CPU runtime); ValueError naming
    the choices for anything the CLI does not offer."""
    if tpu and gpu:
        raise ValueError(f"--tpu {tpu} and --gpu {gpu}: a runtime has one accelerator; give one")
    if tpu:
        match = next((t for t in TPUS if t == tpu.lower()), None)
        if match is None:
            raise ValueError(f"--tpu {tpu}: expected one of {', '.join(TPUS)}")
        return RuntimeKind("tpu", match)
    if gpu:
        match = next((g for g in GPUS if g.lower() == gpu.lower()), None)
        if match is None:
            raise ValueError(f"--gpu {gpu}: expected one of {', '.join(GPUS)}")
        return RuntimeKind("gpu", match)
    return RuntimeKind("cpu")
