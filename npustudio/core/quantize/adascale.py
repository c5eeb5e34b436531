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
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..progress import StateLike
from .layer_training import (
    Prefill,
    capture,
    compiled_forward,
    compiling,
    layer_by_layer,
    lpbq_quantizers,
    on_lpbq_grid,
    regroup,
)


def _aimet_adascale() -> Any:
    """aimet's AdaScale, told that the adapted decoder's 1x1 convolutions are Conv2d layers (its quantizer mapping
    is keyed by exact class)."""
    from aimet_torch.adascale.adascale_optimizer import AdaScale
    from aimet_torch.adascale.adascale_quantizer import AdaScaleConv2dQuantizeDequantize
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

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

        # what forward calls reads no variable of the enclosing function (torch.compile cannot lift those)
        _learned_scale = AdaScaleConv2dQuantizeDequantize.get_scale
        forward = compiled_forward(AdaScaleConv2dQuantizeDequantize.forward)

        def get_scale(self, dtype: Any = None) -> Any:
            return on_lpbq_grid(self.lpbq, self._learned_scale(dtype))

    class DecoderAdaScale(AdaScale):
        @staticmethod
        def _get_adascale_qdq_mapping() -> dict:
            return {**AdaScale._get_adascale_qdq_mapping(), QuantizedConv1x1: ConvQuantizeDequantize}

    return DecoderAdaScale


def stream_loss(fp_out: Any, q_out: Any, _index: int) -> torch.Tensor:
    """aimet's default block loss (FlexRound's: squared error summed over the tokens, averaged over the rest) on
    the layer's output stream (1, D, 1, N); the new KV entries are what that stream was computed from."""
    return (fp_out[0] - q_out[0]).pow(2).sum(-1).mean()


@contextlib.contextmanager
def _saved_tensors_not_mutated() -> Iterator[None]:
    """aimet wraps each AdaScale step in `torch.autograd.graph.allow_mutation_on_saved_tensors`, for blocks that
    update a recurrent state in place (linear attention). The adapted decoder's layers return their new KV entries
    and change nothing autograd saved in place (were one to, autograd would refuse the backward, not compute a
    wrong gradient). That mode dispatches every op through Python and hooks every saved tensor, and keeps
    torch.compile from fusing the quantizer: on a Llama-3.2-1B-shaped gate convolution (LPBQ, 128 tokens) on 2
    cores, a step with it took 2.6x as long as without it. So the steps run without it."""
    import torch.autograd.graph as graph

    real = graph.allow_mutation_on_saved_tensors
    graph.allow_mutation_on_saved_tensors = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        graph.allow_mutation_on_saved_tensors = real


def apply(sim: Any, calib: Sequence[Sequence[int]], prefill: Prefill, iterations: int, state: StateLike) -> None:
    """Optimize every decoder layer's weight encodings with AdaScale on `calib` (before activations are calibrated:
    the activation quantizers are off throughout, as in `apply_adascale`)."""
    from aimet_torch.adascale.adascale_optimizer import _SamplingIterable

    ada = _aimet_adascale()
    grouped = lpbq_quantizers(sim.model)
    for layer, fp_inputs in layer_by_layer(sim, calib, prefill, "AdaScale", state):
        qt_inputs = capture(sim.model, [layer], calib, prefill)[0]
        mixed = _SamplingIterable(qt_inputs, fp_inputs, ratio=0.5)
        # aimet's own progress bar goes to stderr: this stage reports through `state`
        with contextlib.redirect_stderr(io.StringIO()), _saved_tensors_not_mutated(), compiling():
            ada.adascale_block(layer, fp_inputs, mixed, num_iterations=iterations, loss_fn=stream_loss)
    ada.fold_adascale_quantizers(sim.model)
    regroup(sim.model, grouped)
