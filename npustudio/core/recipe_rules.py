"""Which weight-encoding recipes a model can take, told before any work: light (no torch), so `npustudio info`,
the Quantize page and the main job's plan refuse a recipe from the model's card alone."""

from __future__ import annotations

from .errors import UserError
from .shape import DecoderShape
from .stage_options import RECIPE_STEPS

HADAMARD_FACTORS = (1, 12, 20, 28)  # aimet-torch builds Hadamard matrices of 2^n times one of these


def has_hadamard(n: int) -> bool:
    """Whether aimet-torch can build a Hadamard matrix of size `n` (its `get_hadamard_matrix` asserts otherwise)."""
    return any(n % f == 0 and (m := n // f) & (m - 1) == 0 for f in HADAMARD_FACTORS)


def refusal(recipe: str, shape: DecoderShape) -> UserError | None:
    """Why `shape` cannot be quantized with `recipe`, or None."""
    steps = RECIPE_STEPS[recipe]
    if "spinquant" not in steps:
        return None
    if shape.post_norms:
        return UserError("SpinQuant cannot rotate post-norm blocks (OLMo 2): the norm on each block's output sits "
                         "between the layer that writes the stream and the stream, so the rotation cannot be "
                         "folded into the weights.", "Choose a recipe without SpinQuant.")
    for what, n in (("hidden size", shape.hidden), ("head size", shape.head_dim)):
        if not has_hadamard(n):
            return UserError(f"SpinQuant rotates by a Hadamard matrix of the model's {what}, and aimet-torch builds "
                             f"them only for 2^n or 12, 20 or 28 times 2^n: this model's {what} is {n}.",
                             "Choose a recipe without SpinQuant: adascale, seqmse or plain.")
    return None
