"""Where the torch-side work of a stage runs: this machine's CPU, or its CUDA GPU when it has one.

The FP reference, the equivalence proof, AIMET's calibration, SeqMSE and the quantized evaluation run on the
chosen device; file formats, exports and QNN compilation stay on the CPU, so a GPU changes speed, not output.
"""

from __future__ import annotations

from typing import Literal

from .errors import UserError

Device = Literal["auto", "cpu", "cuda"]
DEVICES = ("auto", "cpu", "cuda")


def resolve(device: str) -> str:
    """`auto` -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is refused."""
    import torch

    if device not in DEVICES:
        raise UserError(f"Unknown device {device!r}.", "Use auto, cpu or cuda.")
    if device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise UserError("--device cuda was asked for, but torch sees no CUDA GPU on this machine.",
                        "Use --device auto or cpu, or check the GPU driver (`nvidia-smi`).")
    return "cpu"
