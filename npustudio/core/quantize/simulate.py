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
  [-s, s] encoding through their concat/negation (so they enter the graph as uint16 inputs);
- everything else: 16-bit activations.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..graph.decoder import StaticDecoder
from ..graph.half_weights import HALF, UNPACK, hold_packed, restore_module, widen_module, widened
from ..graph.lora_inputs import ALPHA
from ..progress import heap_blocks_reused, trim_heap
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


def import_aimet() -> None:
    """Import aimet_torch and cut the traceback it keeps.

    aimet_torch keeps the ImportError of its missing C extension (`py_libpymo.IMPORT_ERROR`); the error's
    traceback holds every frame on the stack at the first import, and so whatever those frames held. Imported
    from inside the quantsim build, that was the whole model (5 GB of float weights on a 1B model), alive until
    the process ended: the export could not let it go."""
    import aimet_torch  # noqa: F401
    from aimet_torch.common import py_libpymo

    err = getattr(py_libpymo, "IMPORT_ERROR", None)
    if isinstance(err, BaseException):
        err.__traceback__ = None


def build(model: StaticDecoder, dummy: tuple[torch.Tensor, ...], preset: Preset, target: Soc,
          overrides: Overrides, adapters: dict[str, dict[str, torch.Tensor]] | None = None) -> Any:
    """A configured QuantizationSimModel over `model` (in place: no second copy of the weights); `adapters`: the
    switchable LoRA adapters' input values, by adapter (their inputs' encodings must hold every one of them)."""
    import logging

    import_aimet()
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
    if adapters:
        _configure_lora(sim.model, preset, adapters)
    sim.model.to(next(model.parameters()).device)  # the quantizers `configure` made are on the CPU: where the model is
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


def configure(model: Any, preset: Preset, ov: Overrides) -> None:
    from .aimet_ops import QuantizedConv1x1, QuantizedRMSNorm

    names: dict[Any, str] = {m: n for n, m in model.named_modules()}  # aimet's modules: attributes torch cannot type
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
        if layer.input_norm is None:  # post-norm (OLMo 2): the convs read the float stream, one encoding a block
            for readers in ((*layer.attn.q, *layer.attn.k, *layer.attn.v), (layer.mlp.gate, layer.mlp.up)):
                q = _qdq((), preset.activation_bits, False)
                for conv in readers:
                    conv.input_quantizers[0] = q
        else:
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


def _clear(quantizers: Any) -> None:
    for i in range(len(quantizers)):
        quantizers[i] = None


def _tie_kv(attn: Any, bits: int) -> None:
    """One 8-bit encoding per layer for K and one for V: past_*_in, the new entries and the joined cache."""
    kq, vq = _qdq((), bits, False), _qdq((), bits, False)
    kq._npustudio_kv = vq._npustudio_kv = True
    if attn.k_rope is None:  # a NoPE layer: the new entries are the k convs' outputs (or their q/k norm's)
        for op in [attn.k_norm] if attn.k_norm is not None else attn.k:
            op.output_quantizers[0] = kq
    else:
        attn.k_rope.add.output_quantizers[0] = kq
        if attn.k_rope.keep is not None:  # partial rotary: the new entries are the rotated dims joined with the rest
            attn.k_rope.keep.output_quantizers[0] = kq
    attn.k_cat.input_quantizers[0] = kq
    attn.k_cat.output_quantizers[0] = kq
    for conv in attn.v:
        conv.output_quantizers[0] = vq
    attn.v_cat.input_quantizers[0] = vq
    attn.v_cat.output_quantizers[0] = vq


def _share_mask(model: Any) -> None:
    """The mask feeds every layer's score add: one quantizer, so one encoding."""
    mask = model.layers[0].attn.mask_add.input_quantizers[1]
    for layer in model.layers:
        if layer.attn.mask_add.input_quantizers[1] is not None:
            layer.attn.mask_add.input_quantizers[1] = mask


def _share_rope_tables(model: Any) -> None:
    """cos/sin lie in [-s, s] (s: the RoPE attention scaling yarn and longrope multiply the tables by, else 1):
    one frozen 16-bit encoding for the inputs, the sign flip and the doubled tables. Genie quantizes its own
    tables with this encoding, so it must hold their whole range."""
    import torch as t

    s = max(1.0, abs(float(model.spec.rope_attention_scaling)))
    q = _qdq((), 16, False)
    q.set_range(t.tensor(-s), t.tensor(s))
    q.allow_overwrite(False)
    for op in (model.cos_cat, model.sin_cat, model.sin_neg):
        for qs in (op.input_quantizers, op.output_quantizers):
            for i in range(len(qs)):
                qs[i] = q


def _configure_lora(model: Any, preset: Preset, adapters: dict[str, dict[str, torch.Tensor]]) -> None:
    """The switchable adapters' inputs: each A and B one frozen encoding over all adapters' values (and zero, the
    base), exactly what Genie quantizes an adapter's `.raw` file with; the strength one frozen [0, 1] encoding for
    every slot (1 exact: Genie's default strength). A branch that ends in a V head's output writes the KV cache:
    its Add takes the cache's encoding (a V head's, a NoPE layer's K head's)."""
    import torch as t

    br = model.branches
    alpha = _qdq((), preset.activation_bits, False)
    alpha.set_range(t.tensor(0.0), t.tensor(1.0))
    alpha.allow_overwrite(False)
    for i, s in enumerate(br.slots):
        for mm, name in ((br.a_mm[i], s.a), (br.b_mm[i], s.b)):
            q = _qdq((), preset.activation_bits, False)
            lo = min(0.0, *(float(v[name].min()) for v in adapters.values()))
            hi = max(0.0, *(float(v[name].max()) for v in adapters.values()))
            q.set_range(t.tensor(lo), t.tensor(hi if hi > lo else lo + 1e-6))
            q.allow_overwrite(False)
            mm.input_quantizers[0] = q
        br.strength[i].input_quantizers[1] = alpha
    for conv_name, at in br.at.items():
        kv = model.get_submodule(conv_name).output_quantizers[0]
        if getattr(kv, "_npustudio_kv", False):  # the conv's output is a new cache entry: now the Add's is
            for _i, _rows, key in at:
                br.adds[key].output_quantizers[0] = kv


def input_quantizers(model: Any) -> dict[str, Any]:
    """The quantizers that encode the float graph inputs (by input name)."""
    out = {"position_ids_cos": model.cos_cat.output_quantizers[0],
           "position_ids_sin": model.sin_cat.output_quantizers[0],
           "attention_mask": model.layers[0].attn.mask_add.input_quantizers[1]}
    br = model.branches
    if br is not None:
        for i, s in enumerate(br.slots):
            out[s.a], out[s.b] = br.a_mm[i].input_quantizers[0], br.b_mm[i].input_quantizers[0]
        out[ALPHA] = br.strength[0].input_quantizers[1]
    return out


def fold(sim: Any) -> None:
    """Quantize the weights once instead of on every call: calibration and evaluation run much faster.

    aimet's own fold quantize-dequantizes each weight whole, holding about three copies of the largest one (the
    LM head: 3 GB on a 1B model); here each weight is done a slab of rows at a time into its final tensor, with
    aimet's own arithmetic, so the result is the same tensor aimet makes (a DequantizedTensor carrying its
    encoding, which the ONNX export unfolds again). A weight is quantized into its own storage when no other
    weight still to be folded reads that storage; a tied embedding and LM head share one, so the first of them
    gets a new tensor and the last overwrites the original: one extra copy of the table at a time, not two
    (+1 GB at the fold's peak on a 1B model).

    A weight held in 16 bits (a bf16 checkpoint, `graph.half_weights`) is folded into its integer codes instead,
    one byte a weight where they fit one (every int4 and int8 weight), given back as float32 one module at a
    time while it computes: a 4B model's folded weights take ~4 GB, not 16.
    """
    from aimet_torch.nn import BaseQuantizationMixin

    with heap_blocks_reused():
        param_encodings(sim.model)
    todo = [(module, name, quantizer) for module in sim.model.modules() if isinstance(module, BaseQuantizationMixin)
            for name, quantizer in list(module.param_quantizers.items()) if quantizer is not None]
    # the weights on grids wider than a byte (the 16-bit embedding table) stay float32: folded last, once the 16-bit
    # weights have been packed (a 4B model's 1.6 GB table beside its 8 GB of 16-bit weights was the fold's peak)
    todo.sort(key=lambda t: getattr(t[2], "bitwidth", 32) > 8)
    readers = Counter(getattr(m, n).untyped_storage().data_ptr() for m, n, _ in todo)
    for module, name, quantizer in todo:
        param = getattr(module, name)
        storage = param.untyped_storage().data_ptr()
        readers[storage] -= 1
        narrow = param.dtype in HALF
        into = param.detach().as_subclass(torch.Tensor) if readers[storage] == 0 and not narrow else None
        folded = qdq_by_slabs(param, quantizer, into)
        module.param_quantizers[name] = None
        codes = packed(folded) if narrow else None
        if codes is None:
            setattr(module, name, torch.nn.Parameter(folded, requires_grad=param.requires_grad))
        else:
            hold_packed(module, name, codes, Unpack(cast(Any, folded).encoding))
        del param, folded
    trim_heap()


def frozen(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The calibrated quantsim with each quantizer's encoding computed once for the `with` block instead of on
    every call, and plain tensors between its ops instead of aimet's tensor subclass (whose `__torch_function__`
    wraps every op): aimet's own fast path for generation (`_inference_mode`). The same numbers (the logits of the
    default model's quantsim are bit-identical: tests/test_quantize_ops.py checks a tiny one); an AR-128 step with
    16 AR-1 steps after it took 2.5 s instead of 4.5 s. The weights are folded already (`fold`): none is
    quantized again."""
    from aimet_torch.utils import _inference_mode

    return cast(contextlib.AbstractContextManager[Any], _inference_mode(model, prequantize_parameters=False))


def min_max_observers(model: torch.nn.Module) -> dict[str, Any] | None:
    """Each activation quantizer's min/max observer by module name; None when some quantizer observes otherwise
    (a histogram: its statistics do not merge exactly)."""
    from aimet_torch.quantization.base import QuantizerBase
    from aimet_torch.quantization.encoding_analyzer import MinMaxEncodingAnalyzer

    out = {}
    for name, q in model.named_modules():
        if isinstance(q, QuantizerBase) and hasattr(q, "encoding_analyzer"):
            if type(q.encoding_analyzer) is not MinMaxEncodingAnalyzer:
                return None
            out[name] = q.encoding_analyzer.observer
    return out


def save_observed(observers: dict[str, Any], path: str) -> None:
    """What the min/max observers have seen so far, as a safetensors file (`merge_observed` reads it)."""
    from safetensors.torch import save_file

    save_file({f"{name}.{end}": getattr(o.stats, end).detach().clone().contiguous()
               for name, o in observers.items() for end in ("min", "max") if getattr(o.stats, end) is not None},
              path)


def merge_observed(observers: dict[str, Any], path: str) -> None:
    """Merge what another process's observers saw (`save_observed`) into these, as aimet merges each batch: the
    running minimum and maximum, so the encodings are those of one process seeing every batch."""
    from aimet_torch.quantization.encoding_analyzer import _MinMaxRange
    from safetensors.torch import load_file

    seen = load_file(path)
    for name, o in observers.items():
        if f"{name}.min" in seen or f"{name}.max" in seen:
            o.merge_stats(_MinMaxRange(seen.get(f"{name}.min"), seen.get(f"{name}.max")))


def param_encodings(model: torch.nn.Module) -> None:
    """aimet's `compute_param_encodings`, without the copy of each weight it makes and drops.

    aimet observes a weight by passing it through the quantizer in a pass-through mode that returns a clone: the
    1 GB LM head of a 1B model cost 1 GB more at the fold's peak for nothing. Here the quantizer's encoding analyzer
    sees the weight directly and the range is set as aimet's context exit sets it (a weight already on a symmetric
    grid is first decomposed, as aimet does). LPBQ quantizers, whose encodings are grouped after the analysis, go
    through aimet's own code. tests/test_quantize.py (the slab-fold test) checks them against aimet's."""
    from aimet_torch.nn import BaseQuantizationMixin
    from aimet_torch.quantization.affine import QuantizeDequantize

    for module in model.modules():
        if not isinstance(module, BaseQuantizationMixin):
            continue
        quantizers = module.param_quantizers
        lean = {n: q for n, q in quantizers.items() if type(q) is QuantizeDequantize and getattr(module, n) is not None}
        for n in lean:
            quantizers[n] = None
        held = widen_module(module)  # a 16-bit weight's encoding is computed on its float32 values
        try:
            try:
                module._compute_param_encodings(overwrite=True)  # the others (LPBQ), as aimet does them
            finally:
                for n, q in lean.items():
                    quantizers[n] = q
            for n, q in lean.items():
                if q._allow_overwrite and any(q._is_overwrite_allowed.values()):
                    _observe(q, getattr(module, n).detach().as_subclass(torch.Tensor))
        finally:
            restore_module(module, held)


@torch.no_grad()
def _observe(q: Any, x: torch.Tensor) -> None:
    """What `aimet_torch.nn.base._compute_param_encodings` and the quantizer's `_compute_encodings` context do for one
    weight, minus the pass-through clone."""
    import math

    from aimet_torch.quantization.encoding_analyzer import _flag_extreme_min_max
    from aimet_torch.utils import _decompose_prequantized_tensor, _DecompositionError

    if q.symmetric and math.ceil((q.qmin + q.qmax) / 2) == 0:
        try:
            _, scale = _decompose_prequantized_tensor(x, q.qmin, q.qmax, scale_shape=q.shape, block_size=q.block_size,
                                                      zero_point_shift=q.zero_point_shift)
        except _DecompositionError:
            pass
        else:
            q.set_range(scale * q.qmin, scale * q.qmax)
            return
    if x.numel() == 0:
        return
    a = q.encoding_analyzer
    a.reset_stats()
    a.update_stats(x)
    steps = q.qmax - q.qmin - (1 if q.zero_point_shift == 0.5 else 0)
    lo, hi = a.compute_encodings(steps, q.symmetric)
    if q.block_size is not None:
        lo, hi = lo.view(q.shape), hi.view(q.shape)
    _flag_extreme_min_max(lo, hi)
    q.set_range(lo if q._is_overwrite_allowed["min"] else None, hi if q._is_overwrite_allowed["max"] else None)
    a.reset_stats()


_SLAB = 4 * 2**20  # elements quantized at once


@torch.no_grad()
def qdq_by_slabs(param: torch.Tensor, quantizer: Any, into: torch.Tensor | None = None) -> torch.Tensor:
    """`quantizer(param)` computed row slab by row slab (every encoding here is per tensor, per output channel or
    per block of an output channel, so rows are independent), into a new tensor or `into` (which may be param's
    own storage: each slab is read before it is written); a 16-bit `param` is widened a slab at a time, so the
    result is the float32 one."""
    from aimet_torch.quantization.affine import quantize_dequantize
    from aimet_torch.quantization.tensor import DequantizedTensor

    enc = quantizer.get_encodings()
    x = param.detach().as_subclass(torch.Tensor)
    out = torch.empty_like(x, dtype=torch.float32) if into is None else into
    rows = len(x) if x.dim() else 1
    step = max(1, _SLAB // max(1, x[0].numel() if x.dim() else 1))

    if x.dim() == 0:
        out.copy_(quantize_dequantize(widened(x), enc.scale, enc.offset, enc.qmin, enc.qmax, block_size=enc.block_size,
                                      zero_point_shift=enc.zero_point_shift))
    else:
        for a in range(0, rows, step):
            sl = slice(a, a + step)
            out[sl] = quantize_dequantize(widened(x[sl]), _rows(enc.scale, sl, rows), _rows(enc.offset, sl, rows),
                                          enc.qmin, enc.qmax, block_size=enc.block_size,
                                          zero_point_shift=enc.zero_point_shift)
    res = out.as_subclass(DequantizedTensor)
    res.encoding = enc
    return res


def _rows(t: torch.Tensor, sl: slice, rows: int) -> torch.Tensor:
    return t[sl] if t.dim() and t.shape[0] == rows and rows > 1 else t


@torch.no_grad()
def packed(folded: Any) -> torch.Tensor | None:
    """The int8 codes of a folded weight (a DequantizedTensor on a grid of at most 256 steps), from which
    `unpacked` gives back exactly `folded`; None where the grid is wider or some value does not come back
    bit for bit (the weight then stays float32)."""
    from aimet_torch.quantization.affine import quantize

    enc = folded.encoding
    if enc.qmax - enc.qmin > 255 or folded.dim() == 0 or getattr(enc, "zero_point_shift", 0.0):
        return None
    shift = _shift(enc)
    x = folded.as_subclass(torch.Tensor)
    rows = len(x)
    codes = torch.empty_like(x, dtype=torch.int8)
    step = max(1, _SLAB // max(1, x[0].numel()))
    for a in range(0, rows, step):
        sl = slice(a, a + step)
        scale, offset = _rows(enc.scale, sl, rows), _rows(enc.offset, sl, rows)
        q = quantize(x[sl], scale, offset, enc.qmin, enc.qmax, block_size=enc.block_size)
        if not torch.equal(_dequantized(q.clone(), scale, offset, enc.block_size), x[sl]):
            return None
        codes[sl] = (q.sub_(shift) if shift else q).to(torch.int8)
    return codes


def _shift(enc: Any) -> int:
    """What moves the grid's integers into int8's range (0 for a signed grid of at most 8 bits)."""
    lo, hi = torch.iinfo(torch.int8).min, torch.iinfo(torch.int8).max
    return 0 if lo <= enc.qmin and enc.qmax <= hi else enc.qmin - lo


def _dequantized(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: Any) -> torch.Tensor:
    """aimet's dequantize, `(q + offset) * scale` by blocks, computed in `q`'s own memory (float32 integers)."""
    from aimet_torch.quantization._utils import concretize_block_size, interleave

    view = q
    if block_size is not None:
        block_size = concretize_block_size(q.shape, scale.shape, block_size)
        # (scale dim, block dim) pairs, without the dims of 1 (torch broadcasts a few dims much faster than nine)
        full = interleave(scale.shape, block_size)
        keep = [i for i, n in enumerate(full) if n != 1]
        view = q.view([full[i] for i in keep])
        scale = scale.reshape([interleave(scale.shape, 1)[i] for i in keep])
        offset = offset.reshape([interleave(offset.shape, 1)[i] for i in keep])
    if bool(offset.any()):
        view.add_(offset)
    view.mul_(scale)
    return q


@dataclass(frozen=True)
class Unpack:
    """How a packed weight's float32 values come back (`half_weights.hold_packed`): its codes under `encoding`."""

    encoding: Any

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        return unpacked(codes, self.encoding)


def packed_encoding(module: torch.nn.Module, name: str) -> Any:
    """The encoding of `module.name` held packed (`fold`), else None."""
    unpack = module.__dict__.get(UNPACK, {}).get(name)
    return unpack.encoding if isinstance(unpack, Unpack) else None


@torch.no_grad()
def unpacked(codes: torch.Tensor, encoding: Any) -> torch.Tensor:
    """The float32 weight `packed` took `codes` from (a DequantizedTensor carrying its encoding, as `fold` makes)."""
    from aimet_torch.quantization.tensor import DequantizedTensor

    rows = len(codes)
    out = codes.to(torch.float32)
    if shift := _shift(encoding):
        out.add_(shift)  # the grid's integers again (exact: |q| < 2**24)
    scale, offset = encoding.scale.to(codes.device), encoding.offset.to(codes.device)
    step = max(1, _SLAB // max(1, codes[0].numel()))
    for a in range(0, rows, step):
        sl = slice(a, a + step)
        _dequantized(out[sl], _rows(scale, sl, rows), _rows(offset, sl, rows), encoding.block_size)
    res = out.as_subclass(DequantizedTensor)
    res.encoding = encoding
    return res
