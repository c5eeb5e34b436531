"""Where the torch-side work of a stage runs: this machine's CPU, or its CUDA GPU when it has one.

The FP reference, the equivalence proof, AIMET's calibration, SeqMSE and the quantized evaluation run on the
chosen device; file formats, exports and QNN compilation stay on the CPU, so a GPU changes speed, not output.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from .errors import UserError
from .stage_options import DEVICES as DEVICES  # re-exported: an option's choices, declared there
from .stage_options import Device as Device


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


@contextlib.contextmanager
def seeded(seed: int, device: str) -> Iterator[None]:
    """torch's random draws start from `seed` inside, and the caller's generators are as they were after: a recipe
    that draws (AdaScale mixes float and quantized inputs at random) gives the same encodings run after run."""
    import torch

    with torch.random.fork_rng(devices=[torch.device(device)] if device == "cuda" else []):
        torch.manual_seed(seed)
        yield


P = ParamSpec("P")
R = TypeVar("R")


def plain_convolutions(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a torch stage with oneDNN's convolutions off. oneDNN reorders a convolution's weight into its own
    layout on every call: the LM head of a 128k-token vocabulary (1 GB as a 1x1 convolution) was copied at each
    forward, +1 GB at the stage's peak; the adapted graphs' 1x1 convolutions also run 2-3x faster as the plain
    matrix products torch falls back to (measured on 2 cores with Llama-3.2-1B's shapes, AR-128)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        # on a GPU, cuDNN's TF32 convolutions round the 1x1 convolutions' inputs to 10 bits: the adapted SmolLM2
        # shape's logits then differed from the HF model's by 1.9e-3 against 1e-5 in float32
        with torch.backends.mkldnn.flags(enabled=False), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            return fn(*args, **kwargs)

    return wrapper
