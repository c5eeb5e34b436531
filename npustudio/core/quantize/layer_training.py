"""What the layer-by-layer weight-encoding learners (AdaScale, OmniQuant) share on the adapted decoder.

- each layer's inputs, captured from the real prompt loop (the host KV-cache runner Genie's loop mirrors: the
  second AR-N chunk of a sequence attends to the first one's cache), not from one whole-sequence call;
- LPBQ's own scale grid while a quantizer learns (each block an integer 1..16 times its channel's scale,
  straight-through for the gradient), so the encodings it ends with are exactly the LPBQ encodings exported;
- each LPBQ weight's grouped quantizer back afterwards, over the ranges learned (aimet's learners leave plain
  block quantizers);
- the learning quantizer's forward through torch.compile (`compiled_forward`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..progress import StateLike, about_duration

log = logging.getLogger(__name__)

Capture = list[tuple[tuple[Any, ...], dict[str, Any]]]
Prefill = Callable[[torch.nn.Module, Sequence[int]], object]


def layer_by_layer(sim: Any, calib: Sequence[Sequence[int]], prefill: Prefill, what: str,
                   state: StateLike) -> Iterator[tuple[torch.nn.Module, Capture]]:
    """Each decoder layer of `sim` in order, with the float model's inputs to it on `calib`, the weight encodings
    computed and the activation quantizers off (a learner's weight encodings come before activations are
    calibrated, as in aimet's); progress is said and a cancel lands between layers (the stage stops there and
    writes no output: what was learned so far lived in this process's model only)."""
    from aimet_torch.nn import compute_param_encodings
    from aimet_torch.utils import remove_activation_quantizers, remove_all_quantizers

    model = sim.model
    compute_param_encodings(model)
    model.requires_grad_(False)
    layers = list(model.layers)
    with remove_activation_quantizers(model):
        with remove_all_quantizers(model):
            fp_inputs = capture(model, layers, calib, prefill)
        began = time.monotonic()
        for i, layer in enumerate(layers):
            state.check()
            left = f", {about_duration((time.monotonic() - began) / i * (len(layers) - i))} left" if i else ""
            state.progress(i / len(layers), f"{what}: layer {i + 1} of {len(layers)}{left}")
            yield layer, fp_inputs[i]
            fp_inputs[i] = []
    state.progress(1.0, f"{what}: done")


def compiled_forward(forward: Callable[[Any, torch.Tensor], Any]) -> Callable[[Any, torch.Tensor], Any]:
    """A learning quantizer's `forward` through torch.compile, or `forward` itself where that does not compile.

    Each step a learner's quantizer makes some twenty element-wise passes over its whole weight, forward and
    backward (the per-weight scale, LPBQ's block scales, the rounding and its mask); the compiler fuses them.
    Measured on Llama-3.2-1B-shaped LPBQ weights on 2 cores, forward and backward: the 8192 x 2048 gate 0.52 s
    eager, 0.16 s compiled; weights and gradients agree to float rounding (the fused exp and divisions may
    differ by an ulp). Each quantizer compiles its own bound forward (an unbound one, the quantizer an argument,
    does not trace through aimet's autograd function); quantizers of one weight shape share the compiled graph.
    torch.compile needs a C++ compiler for the CPU (Triton for a CUDA GPU): without one the first call fails and
    every call runs eager, with a warning in the log."""
    import types

    eager = False

    def call(quantizer: Any, x: torch.Tensor) -> Any:
        nonlocal eager
        if not eager:
            fast = quantizer.__dict__.get("_compiled_forward")
            if fast is None:
                fast = quantizer.__dict__["_compiled_forward"] = torch.compile(types.MethodType(forward, quantizer))
            try:
                return fast(x)
            except Exception as e:  # a compiler missing or failing: the same function, eager
                eager = True
                log.warning("torch.compile failed (%s: %s); the learners' quantizers run eager (slower)",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return forward(quantizer, x)

    return call


def compiling() -> contextlib.AbstractContextManager[None]:
    """torch.compile's settings while quantizers from `compiled_forward` learn: a decoder's weight shapes (q, k/v,
    o, gate/up, down), with and without gradients, one graph each, within the recompile limit."""
    import torch._dynamo.config

    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 32))


def on_lpbq_grid(lpbq: Any, raw: torch.Tensor | None) -> torch.Tensor | None:
    """`raw` block scales as LPBQ rounds them for `lpbq` (a GroupedBlockQuantizeDequantize; None: left as they are)."""
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize
    from aimet_torch.quantization.affine.backends import quantize_dequantize

    if lpbq is None or raw is None:
        return raw
    per_channel = GroupedBlockQuantizeDequantize._get_per_channel_scale(lpbq, raw)
    return quantize_dequantize(raw, per_channel, torch.zeros_like(per_channel), qmin=1,
                               qmax=2 ** (lpbq.decompressed_bw - lpbq.bitwidth), block_size=lpbq.block_grouping)


@torch.no_grad()
def capture(model: torch.nn.Module, layers: list[torch.nn.Module], calib: Sequence[Sequence[int]],
            prefill: Prefill) -> list[Capture]:
    """Every call's (args, kwargs) into each of `layers` while the prompt loop reads `calib`, on the CPU (copied
    when seen: the runner updates its KV cache in place). The decoder computes only as far as the last of them
    (`_computing_through`)."""
    seen: list[Capture] = [[] for _ in layers]

    def hook(i: int) -> Callable[..., None]:
        def keep(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen[i].append(_detached((args, kwargs)))
        return keep

    decoder: Any = model  # the adapted decoder (StaticDecoder), its quantsim's
    last = max(i for i, layer in enumerate(decoder.layers) if any(layer is m for m in layers))
    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with _computing_through(decoder, last):
            for seq in calib:
                prefill(model, seq)
    finally:
        for h in handles:
            h.remove()
    # cloned again here: copies made inside the runner's inference mode cannot take part in autograd
    return [[_detached(c) for c in calls] for calls in seen]


@contextlib.contextmanager
def _computing_through(model: Any, last: int) -> Iterator[None]:
    """The decoder's layers after layer `last` pass the stream through and return empty KV entries, its LM head
    zeros: a layer's inputs never depend on what comes after it (a chunk's cache entries are the layer's own),
    and a learner captures layer after layer, each time through the quantized model (a Llama-3.2-1B-shaped
    model on 2 cores, w4a16, 4 calibration sequences of 2 AR-128 chunks: layer 8's inputs in 28 s instead of 71)."""
    skipped = [*list(model.layers)[last + 1:], model.lm_head]
    for m in skipped[:-1]:
        m.forward = _passes_through
    model.lm_head.forward = _no_logits(model.lm_head.weight.shape[0])
    try:
        yield
    finally:
        for m in skipped:
            del m.forward


def _passes_through(h: torch.Tensor, _rope: Any, _mask: Any, past_k: torch.Tensor, past_v: torch.Tensor,
                    _lin: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = h.shape[-1]
    return h, past_k.new_zeros(*past_k.shape[:3], n), past_v.new_zeros(*past_v.shape[:2], n, past_v.shape[3])


def _no_logits(vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x.new_zeros(x.shape[0], vocab, 1, x.shape[-1])


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().as_subclass(torch.Tensor).cpu().clone()
    if isinstance(x, tuple | list):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def lpbq_quantizers(model: torch.nn.Module) -> dict[Any, Any]:
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

    from .aimet_ops import QuantizedConv1x1

    return {m: m.param_quantizers["weight"] for m in model.modules()
            if isinstance(m, QuantizedConv1x1) and isinstance(m.param_quantizers["weight"],
                                                                GroupedBlockQuantizeDequantize)}


@torch.no_grad()
def regroup(model: torch.nn.Module, grouped: dict[Any, Any]) -> None:
    """Each LPBQ weight's grouped quantizer back, over the block ranges AdaScale learned, frozen there."""
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

    for module, old in grouped.items():
        learned = module.param_quantizers["weight"]
        q = GroupedBlockQuantizeDequantize(old.shape, bitwidth=old.bitwidth, symmetric=True,
                                           decompressed_bw=old.decompressed_bw, block_size=old.block_size,
                                           block_grouping=old.block_grouping)
        q.set_range(learned.min, learned.max)
        q.allow_overwrite(False)
        module.param_quantizers["weight"] = q.to(learned.min.device)
