"""OmniQuant, Qualcomm's implementation from aimet-torch (`aimet_torch.experimental.omniquant`), on the adapted decoder.

OmniQuant learns, a decoder layer at a time against the float layer, two things that leave the float model
unchanged: LET scales (a per-channel factor divided out of one layer's output channels and multiplied into the
next one's input channels) and LWC (each weight quantizer's clipping range). aimet's `apply_omniquant` finds
Hugging Face Llama/Qwen2/Mistral blocks by class and pairs their Linear layers; this adapter pairs the adapted
decoder's 1x1 convolutions the same way and drives aimet's own pieces (its LET/LWC quantizer, its training step,
its fold):
- input norm -> every q, k and v head; post norm -> gate and up (pre-norm blocks: a post-norm block (OLMo 2)
  has no norm in front of them, so those two pairs are left out);
- each KV head's v -> the o input channels of the query heads that read it (the adapted o reads heads in
  order, head h = j*G + i from KV head j: aimet's GQA repeat interleaves per channel, a Linear layout);
- up -> down.
The v scales also divide the v entries already in the KV cache while a layer learns (a second AR-N chunk reads
the first one's): after the fold the graph writes its cache already divided, so the cache stays consistent.
Each step is aimet's `_block_wise_training_step` (MSE summed over the layer's output stream against the layer
without quantizers, AdamW at aimet's learning rate) on the float model's inputs to that layer from the real
prompt loop; LET is then folded into the weights and norm gains (aimet's `fold_let_params`), and each weight gets
its quantizer back over the range it learned (LPBQ regrouped, frozen there).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..progress import StateLike
from .layer_training import Prefill, layer_by_layer, lpbq_quantizers, on_lpbq_grid, regroup


def _quantizer_classes() -> tuple[type, type]:
    """aimet's OmniQuant quantizer for a conv weight (LET and LWC; an LPBQ weight through LPBQ's scale grid) and
    for a norm gain (LET only)."""
    from aimet_torch.experimental.omniquant.let_quantizer import OmqQuantizeDequantize
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize, QuantizeDequantize

    class Layout:
        """aimet's `_update_param` scales a Linear's 2-D weight and repeats a follow scale per channel: these take
        a conv's (out, in, 1, 1) weight, a slice of a shared prev scale (one KV head's v of all heads' scale) and
        a follow scale gathered per input channel (o's channels from the KV head each query head reads)."""

        prev_part: slice | None = None
        foll_index: torch.Tensor | None = None

        def _update_param(self, weight: torch.Tensor) -> torch.Tensor:
            prev, foll = getattr(self, "prev_scale", None), getattr(self, "foll_scale", None)
            w = weight.flatten(1) if weight.dim() > 2 else weight
            if prev is not None:
                p = prev[self.prev_part] if self.prev_part is not None else prev
                w = w / (p.reshape(-1, 1) if w.dim() > 1 else p)
            if foll is not None:
                w = w * (foll[self.foll_index] if self.foll_index is not None else foll)
            return w.reshape(weight.shape)

    class WeightOmq(Layout, OmqQuantizeDequantize, QuantizeDequantize):
        def __init__(self, qdq: Any) -> None:
            super().__init__(qdq)
            self.lpbq = qdq if isinstance(qdq, GroupedBlockQuantizeDequantize) else None

        def get_scale(self, dtype: Any = None) -> Any:
            return on_lpbq_grid(self.lpbq, super().get_scale(dtype))

    class GainOmq(Layout, OmqQuantizeDequantize, torch.nn.Module):
        pass

    return WeightOmq, GainOmq


def _let_pairs(layer: Any) -> list[tuple[list[Any], list[Any]]]:
    """The layer's LET pairs as aimet pairs a Llama block: (modules whose outputs are divided, modules whose
    inputs are multiplied)."""
    attn, mlp = layer.attn, layer.mlp
    pairs = [(list(attn.v), [attn.o]), ([mlp.up], [mlp.down])]
    if layer.input_norm is not None:  # pre-norm
        pairs += [([layer.input_norm], [*attn.q, *attn.k, *attn.v]), ([layer.post_norm], [mlp.gate, mlp.up])]
    return pairs


def _install(layer: Any, weight_omq: type, gain_omq: type) -> tuple[list[torch.nn.Parameter], Callable[[], None]]:
    """OmniQuant's quantizers on `layer` with LET scales registered (all ones: the float layer unchanged); returns
    the parameters to learn and a function that folds the scales and restores quantizers that take part in export."""
    from .aimet_ops import QuantizedConv1x1

    convs = [m for m in layer.modules() if isinstance(m, QuantizedConv1x1)]
    before = {m: dict(m.param_quantizers.items()) for m in layer.modules() if hasattr(m, "param_quantizers")}
    for m in convs:
        m.param_quantizers["weight"] = weight_omq(m.param_quantizers["weight"])
    attn, hd, g = layer.attn, layer.attn.hd, layer.attn.g
    pairs = _let_pairs(layer)
    scales: list[torch.nn.Parameter] = []
    for prev, follow in pairs:
        width = sum(m.weight.shape[0] for m in prev)
        s = torch.nn.Parameter(torch.ones(width, device=follow[0].weight.device))
        scales.append(s)
        at = 0
        for m in prev:
            n = m.weight.shape[0]
            for key in ("weight", "bias"):
                if getattr(m, key, None) is None:
                    continue
                if key == "bias" or m.param_quantizers[key] is None:  # a bias, a norm's gain: scaled, float
                    m.param_quantizers[key] = gain_omq()
                m.param_quantizers[key].register_let_params(prev_scale=s)
                m.param_quantizers[key].prev_part = slice(at, at + n) if len(prev) > 1 else None
            at += n
        for m in follow:
            m.param_quantizers["weight"].register_let_params(foll_scale=s)
            if m is attn.o:  # o's channel c: query head c // hd, which reads KV head (c // hd) // G
                c = torch.arange(m.weight.shape[1], device=s.device)
                m.param_quantizers["weight"].foll_index = (c // hd) // g * hd + c % hd
    v_scale = scales[next(i for i, (prev, _) in enumerate(pairs) if prev[0] is attn.v[0])]

    def divide_cached_v(_m: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The cache's earlier v entries (KV, 1, CL-N, hd) divided like the new ones, while the scales learn (not
        in the float target's pass: aimet runs it with every quantizer removed)."""
        if attn.v[0].param_quantizers["weight"] is None:
            return None
        return (args[0] / v_scale.reshape(len(attn.v), 1, 1, hd), *args[1:])

    hook = attn.v_cat.register_forward_pre_hook(divide_cached_v)

    def fold() -> None:
        hook.remove()
        with torch.no_grad():
            for m, old in before.items():
                for key, q in list(m.param_quantizers.items()):
                    if q is None or q is old.get(key) or not hasattr(q, "fold_let_params"):
                        continue
                    q.fold_let_params(m, key)
                    if isinstance(q, weight_omq):
                        m.param_quantizers[key] = _learned(q, old[key])
                    else:
                        m.param_quantizers[key] = old.get(key)

    return [*scales, *(p for m in convs for p in (m.param_quantizers["weight"].min,
                                                  m.param_quantizers["weight"].max))], fold


def _learned(q: Any, old: Any) -> Any:
    """A quantizer over the range `q` learned, frozen there: aimet's own `get_qdq` (LPBQ keeps its grouped
    quantizer until `regroup`: the learned ranges go on through it)."""
    if q.lpbq is not None:
        old.set_range(q.min.detach(), q.max.detach())  # the learned range, read back by regroup
        return old
    fresh = q.get_qdq()
    fresh.allow_overwrite(False)
    return fresh.to(q.min.device)


def apply(sim: Any, calib: Sequence[Sequence[int]], prefill: Prefill, iterations: int, state: StateLike) -> None:
    """OmniQuant on every decoder layer of `sim` with `iterations` steps each, over the float model's inputs to
    that layer on `calib` (before activations are calibrated: the activation quantizers are off throughout, as in
    `apply_omniquant`)."""
    from aimet_torch.experimental.omniquant.omniquant_optimizer import OMNIQUANT_LR, Omniquant

    weight_omq, gain_omq = _quantizer_classes()
    grouped = lpbq_quantizers(sim.model)
    device = next(sim.model.parameters()).device
    loss_fn = torch.nn.MSELoss(reduction="sum")
    for layer, fp_inputs in layer_by_layer(sim, calib, prefill, "OmniQuant", state):
        params, fold = _install(layer, weight_omq, gain_omq)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW([{"params": params, "lr": OMNIQUANT_LR, "weight_decay": 0.0}])
        calls = [SimpleNamespace(args=a, kwargs=k) for a, k in fp_inputs]
        with contextlib.redirect_stderr(io.StringIO()), _quiet(), torch.enable_grad():
            for step in range(iterations):  # aimet's loop: a step a call, round the calls
                call = calls[step % len(calls)]
                Omniquant._block_wise_training_step(call, call, layer, [], optimizer, loss_fn, device)
        for p in params:
            p.requires_grad_(False)
        fold()
    regroup(sim.model, grouped)


@contextlib.contextmanager
def _quiet() -> Any:
    """aimet logs each layer's loss at INFO: this stage reports through `state`."""
    log = logging.getLogger("Quant")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
