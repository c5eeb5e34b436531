"""Build and configure the aimet-torch quantization simulator for the adapted decoder.

What the HTP needs, set explicitly rather than left to the config file's op-type guesses:
- Conv1x1 weights symmetric int8 per output channel (w8) or int4 LPBQ blocks of 64 along the input
  channels with 8-bit per-channel scales (w4); the LM head int8 per channel; the embedding table a
  per-tensor 16-bit Gather;
- the residual stream stays float: residual Adds and the RMSNorm input/gain carry no quantizer (they
  run fp16-safe in fp16 on the HTP; a 16-bit grid over |h|≈2e4 outliers destroys the model);
- each layer's KV cache is 8-bit with ONE encoding shared by `past_*_in`, `past_*_out` and the
  Concat that joins them (Genie copies cache entries without requantizing);
- the attention mask, an input every layer adds, gets one encoding; the cos/sin tables one fixed
  [-1, 1] encoding through their concat/negation (so they enter the graph as uint16 inputs);
- everything else: 16-bit activations.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..adapt.decoder import StaticDecoder
from ..targets import Soc
from .presets import Overrides, Preset


def config_file(target: Soc) -> str:
    """aimet-torch's HTP quantsim config for the target arch (the nearest older one it ships)."""
    import aimet_torch.common.quantsim_config as qc

    folder = os.path.dirname(qc.__file__)
    for n in range(target.arch_number, 65, -1):
        path = os.path.join(folder, f"htp_quantsim_config_v{n}.json")
        if os.path.exists(path):
            return path
    return os.path.join(folder, "default_config_per_channel.json")


def build(model: StaticDecoder, dummy: tuple[torch.Tensor, ...], preset: Preset, target: Soc,
          overrides: Overrides) -> Any:
    """A configured QuantizationSimModel over `model` (in place: no second copy of the weights)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module="aimet_torch")
    from aimet_torch.common.defs import QuantScheme
    from aimet_torch.common.utils import AimetLogger

    AimetLogger.set_level_for_all_areas(logging.WARNING)  # its INFO lines go to stdout and break --json
    from aimet_torch.quantsim import QuantizationSimModel

    from . import aimet_ops  # noqa: F401  (registers the adapted ops)

    sim = QuantizationSimModel(model, dummy_input=dummy, quant_scheme=QuantScheme.post_training_tf,
                               default_output_bw=preset.activation_bits, default_param_bw=preset.weight_bits,
                               config_file=config_file(target), in_place=True)
    configure(sim.model, preset, overrides)
    return sim


def _qdq(shape: tuple[int, ...], bits: int, symmetric: bool) -> Any:
    from aimet_torch.quantization.affine import QuantizeDequantize

    return QuantizeDequantize(shape, bitwidth=bits, symmetric=symmetric)


def _lpbq(shape: tuple[int, ...], bits: int, block: tuple[int, ...]) -> Any:
    from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

    return GroupedBlockQuantizeDequantize(shape, bitwidth=bits, symmetric=True, decompressed_bw=8,
                                          block_size=block, block_grouping=(1, -1, 1, 1))


def weight_quantizer(weight: torch.Tensor, bits: int, block_size: int | None) -> Any:
    """Symmetric per-output-channel, or LPBQ (4-bit blocks along input channels, int8 per-channel scale)."""
    out_c, in_c = weight.shape[:2]
    if bits <= 4 and block_size and in_c % block_size == 0 and in_c > block_size:
        return _lpbq((out_c, in_c // block_size, 1, 1), bits, (1, block_size, 1, 1))
    return _qdq((out_c, 1, 1, 1), bits, True)


def configure(model: torch.nn.Module, preset: Preset, ov: Overrides) -> None:
    from .aimet_ops import QuantizedConv1x1, QuantizedRMSNorm

    names = {m: n for n, m in model.named_modules()}
    for m, name in names.items():
        if isinstance(m, QuantizedConv1x1):
            default = preset.head_bits if name == "lm_head" else preset.weight_bits
            bits = ov.weight_bits(name, default)
            m.param_quantizers["weight"] = weight_quantizer(m.weight, bits, preset.block_size)
        elif isinstance(m, QuantizedRMSNorm):
            m.param_quantizers["weight"] = None  # a gain: float costs nothing and stays exact
    model.embed.param_quantizers["weight"] = _qdq((), ov.weight_bits("embed", preset.embedding_bits), False)

    for layer in model.layers:
        # the residual stream stays float: the adds and what the residual norms read from it
        for op in (layer.attn_add, layer.mlp_add):
            _clear(op.input_quantizers)
            _clear(op.output_quantizers)
        for op in (layer.input_norm, layer.post_norm):
            _clear(op.input_quantizers)
        _tie_kv(layer.attn, preset.kv_bits)
    _clear(model.norm.input_quantizers)
    _share_mask(model)
    _share_rope_tables(model)
    if ov.activations:
        _override_activations(names, ov)


def _override_activations(names: dict[torch.nn.Module, str], ov: Overrides) -> None:
    for m, name in names.items():
        for q in list(getattr(m, "output_quantizers", [])) + list(getattr(m, "input_quantizers", [])):
            if q is not None and not getattr(q, "_npustudio_kv", False):
                bits = ov.activation_bits(name, q.bitwidth)
                if bits != q.bitwidth:
                    q.bitwidth = bits


def _clear(quantizers: torch.nn.ModuleList) -> None:
    for i in range(len(quantizers)):
        quantizers[i] = None


def _tie_kv(attn: torch.nn.Module, bits: int) -> None:
    """One 8-bit encoding per layer for K and one for V: past_*_in, the new entries and the joined cache."""
    kq, vq = _qdq((), bits, False), _qdq((), bits, False)
    kq._npustudio_kv = vq._npustudio_kv = True
    attn.k_rope.add.output_quantizers[0] = kq
    attn.k_cat.input_quantizers[0] = kq
    attn.k_cat.output_quantizers[0] = kq
    for conv in attn.v:
        conv.output_quantizers[0] = vq
    attn.v_cat.input_quantizers[0] = vq
    attn.v_cat.output_quantizers[0] = vq


def _share_mask(model: torch.nn.Module) -> None:
    """The mask feeds every layer's score add: one quantizer, so one encoding."""
    mask = model.layers[0].attn.mask_add.input_quantizers[1]
    for layer in model.layers:
        if layer.attn.mask_add.input_quantizers[1] is not None:
            layer.attn.mask_add.input_quantizers[1] = mask


def _share_rope_tables(model: torch.nn.Module) -> None:
    """cos/sin lie in [-1, 1]: one frozen 16-bit encoding for the inputs, the sign flip and the doubled tables."""
    import torch as t

    q = _qdq((), 16, False)
    q.set_range(t.tensor(-1.0), t.tensor(1.0))
    q.allow_overwrite(False)
    for op in (model.cos_cat, model.sin_cat, model.sin_neg):
        for qs in (op.input_quantizers, op.output_quantizers):
            for i in range(len(qs)):
                qs[i] = q


def input_quantizers(model: torch.nn.Module) -> dict[str, Any]:
    """The quantizers that encode the float graph inputs (by input name)."""
    return {"position_ids_cos": model.cos_cat.output_quantizers[0],
            "position_ids_sin": model.sin_cat.output_quantizers[0],
            "attention_mask": model.layers[0].attn.mask_add.input_quantizers[1]}


def fold(sim: Any) -> None:
    """Quantize the weights once instead of on every call: calibration and evaluation run much faster.

    The encodings stay attached to the folded weights; aimet's ONNX export unfolds them again.
    """
    from aimet_torch.nn import compute_param_encodings

    compute_param_encodings(sim.model)
    sim.fold_param_quantizers()
