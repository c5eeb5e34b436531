"""AdaScale, Qualcomm's block-wise weight-quantization PTQ from aimet-torch, on the adapted decoder.

aimet's `apply_adascale` finds its blocks by Hugging Face class (LlamaDecoderLayer, ...) and chains each block's
output into the next block's only input. The adapted decoder's layers are ours, and each takes the rotary tables,
the mask and its own KV cache beside the stream and returns its new cache entries with it: so this adapter does the
two things `apply_adascale` does around Qualcomm's optimizer, the rest is aimet's own code:
- each layer's inputs are captured from the real prompt loop (the host KV-cache runner Genie's loop mirrors: the
  second AR-N chunk of a sequence attends to the first one's cache), once from the float model and once from the
  weight-quantized one with the layers before it already optimized, mixed half and half as aimet mixes them;
- `AdaScale.adascale_block` learns each layer's weight-quantizer scales (beta/gamma clipping, s2-s4 weight
  scales) against the float layer's output stream; `fold_adascale_quantizers` folds them into the weights.
An LPBQ weight learns through LPBQ's own scale rounding and gets its grouped quantizer back over the learned range
afterwards (aimet's fold leaves a plain block quantizer): what is exported is the LPBQ the compiler takes (int4
blocks, integer block scales under a per-channel scale), with the encodings AdaScale ended with.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..progress import StateLike, about_duration

Capture = list[tuple[tuple[Any, ...], dict[str, Any]]]


def _aimet_adascale() -> Any:
    """aimet's AdaScale, told that the adapted decoder's 1x1 convolutions are Conv2d layers (its quantizer mapping
    is keyed by exact class)."""
    from aimet_torch.adascale.adascale_optimizer import AdaScale
    from aimet_torch.adascale.adascale_quantizer import AdaScaleConv2dQuantizeDequantize
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize
    from aimet_torch.quantization.affine.backends import quantize_dequantize

    from .aimet_ops import QuantizedConv1x1

    class ConvQuantizeDequantize(AdaScaleConv2dQuantizeDequantize):
        """aimet's Conv2d AdaScale quantizer, for an LPBQ weight learning through LPBQ's own scale grid.

        - Its per-weight scale s2 is shaped as the weight also for block quantizers (aimet 2.42 shapes it by
          blocks, (out, in/B, B, 1, 1, 1, 1), which does not broadcast against a conv weight): s2 is FlexRound's
          element-wise scale, the same numbers either way.
        - An LPBQ weight's block scales go through aimet's own LPBQ rounding (each block an integer 1..16 times
          the channel's scale, straight-through for the gradient) while AdaScale learns them: the encodings it
          ends with are then exactly the LPBQ encodings exported, not float block scales rounded afterwards
          (measured on the default model at 150 steps a layer: ratio 1.179 with the rounding only afterwards)."""

        def __init__(self, qdq: Any, weight_shape: torch.Size) -> None:
            super().__init__(qdq, weight_shape)
            self.s2 = torch.nn.Parameter(torch.zeros(weight_shape, device=qdq.min.device))
            self.lpbq = qdq if isinstance(qdq, GroupedBlockQuantizeDequantize) else None

        def get_scale(self, dtype: Any = None) -> Any:
            raw = super().get_scale(dtype)
            if self.lpbq is None or raw is None:
                return raw
            per_channel = GroupedBlockQuantizeDequantize._get_per_channel_scale(self.lpbq, raw)
            return quantize_dequantize(raw, per_channel, torch.zeros_like(per_channel), qmin=1,
                                       qmax=2 ** (self.lpbq.decompressed_bw - self.lpbq.bitwidth),
                                       block_size=self.lpbq.block_grouping)

    class DecoderAdaScale(AdaScale):
        @staticmethod
        def _get_adascale_qdq_mapping() -> dict:
            return {**AdaScale._get_adascale_qdq_mapping(), QuantizedConv1x1: ConvQuantizeDequantize}

    return DecoderAdaScale


def stream_loss(fp_out: Any, q_out: Any, _index: int) -> torch.Tensor:
    """aimet's default block loss (FlexRound's: squared error summed over the tokens, averaged over the rest) on
    the layer's output stream (1, D, 1, N); the new KV entries are what that stream was computed from."""
    return (fp_out[0] - q_out[0]).pow(2).sum(-1).mean()


def apply(sim: Any, calib: Sequence[Sequence[int]], prefill: Callable[[torch.nn.Module, Sequence[int]], object],
          iterations: int, state: StateLike) -> None:
    """Optimize every decoder layer's weight encodings with AdaScale on `calib` (before activations are calibrated:
    the activation quantizers are off throughout, as in `apply_adascale`)."""
    from aimet_torch.adascale.adascale_optimizer import _SamplingIterable
    from aimet_torch.nn import compute_param_encodings
    from aimet_torch.utils import remove_activation_quantizers, remove_all_quantizers

    ada = _aimet_adascale()
    model = sim.model
    grouped = _lpbq_quantizers(model)
    compute_param_encodings(model)
    model.requires_grad_(False)
    layers = list(model.layers)
    with remove_activation_quantizers(model):
        with remove_all_quantizers(model):
            fp_inputs = _capture(model, layers, calib, prefill)
        began = time.monotonic()
        for i, layer in enumerate(layers):
            state.check()  # a cancel lands between layers: nothing is folded yet, the stage output is not written
            left = f", {about_duration((time.monotonic() - began) / i * (len(layers) - i))} left" if i else ""
            state.progress(i / len(layers), f"AdaScale: layer {i + 1} of {len(layers)}{left}")
            qt_inputs = _capture(model, [layer], calib, prefill)[0]
            mixed = _SamplingIterable(qt_inputs, fp_inputs[i], ratio=0.5)
            with contextlib.redirect_stderr(io.StringIO()):  # aimet's own bar: this stage reports through `state`
                ada.adascale_block(layer, fp_inputs[i], mixed, num_iterations=iterations, loss_fn=stream_loss)
            fp_inputs[i] = []
    ada.fold_adascale_quantizers(model)
    _regroup(model, grouped)
    state.progress(1.0, "AdaScale: done")


@torch.no_grad()
def _capture(model: torch.nn.Module, layers: list[torch.nn.Module], calib: Sequence[Sequence[int]],
             prefill: Callable[[torch.nn.Module, Sequence[int]], object]) -> list[Capture]:
    """Every call's (args, kwargs) into each of `layers` while the prompt loop reads `calib`, on the CPU (copied
    when seen: the runner updates its KV cache in place)."""
    seen: list[Capture] = [[] for _ in layers]

    def hook(i: int) -> Callable[..., None]:
        def keep(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen[i].append(_detached((args, kwargs)))
        return keep

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for seq in calib:
            prefill(model, seq)
    finally:
        for h in handles:
            h.remove()
    # cloned again here: copies made inside the runner's inference mode cannot take part in autograd
    return [[_detached(c) for c in calls] for calls in seen]


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().as_subclass(torch.Tensor).cpu().clone()
    if isinstance(x, tuple | list):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _lpbq_quantizers(model: torch.nn.Module) -> dict[Any, Any]:
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

    from .aimet_ops import QuantizedConv1x1

    return {m: m.param_quantizers["weight"] for m in model.modules()
            if isinstance(m, QuantizedConv1x1) and isinstance(m.param_quantizers["weight"],
                                                                GroupedBlockQuantizeDequantize)}


@torch.no_grad()
def _regroup(model: torch.nn.Module, grouped: dict[Any, Any]) -> None:
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
