"""aimet-torch quantsim wraps every op of the adapted decoder, and w8a16 keeps a tiny model's perplexity."""

from __future__ import annotations

import os
import shutil
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

from npustudio.core import pipeline
from npustudio.core.adapt import AdaptOptions
from npustudio.core.evaluate import compare, load_corpus
from npustudio.core.graph import store
from npustudio.core.graph.decoder import io_names
from npustudio.core.graph.kv_cache import KVCacheRunner
from npustudio.core.progress import State
from npustudio.core.project import Project


def test_quantsim_wraps_the_adapted_decoder_and_w8a16_keeps_perplexity(tiny_llama: Path, tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    import aimet_torch.common.quantsim_config as qc
    from aimet_torch.common.defs import QuantScheme
    from aimet_torch.quantsim import QuantizationSimModel

    import npustudio.core.quantize.aimet_ops  # noqa: F401  (registers the quantized op definitions)

    p = Project.open(tmp_path / "p")
    pipeline.adapt(p, str(tiny_llama), AdaptOptions(ar=32, cl=128, eval_chars=2500, window=128, decode_tokens=8),
                   State())
    model, inv = store.load(p.stage_dir("adapt"))
    fp = KVCacheRunner.over(model, 32, 128, inv)
    dummy = tuple(fp.feeds([1, 2, 3], 32)[n] for n in io_names(model.spec.layers)[0])
    cfg = os.path.join(os.path.dirname(qc.__file__), "htp_quantsim_config_v79.json")
    sim = QuantizationSimModel(model, dummy_input=dummy, quant_scheme=QuantScheme.post_training_tf,
                               default_output_bw=16, default_param_bw=8, config_file=cfg, in_place=False)
    leaves = [m for m in sim.model.modules() if not list(m.children()) or hasattr(m, "param_quantizers")]
    plain = [type(m).__name__ for m in leaves if not type(m).__name__.startswith("Quantized")
             and not type(m).__module__.startswith("aimet_torch.quantization")
             and type(m).__name__ not in ("ModuleList", "ModuleDict")]
    assert plain == []  # every op of the adapted graph has a quantizer

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(p.stage_dir("adapt"))
    q = KVCacheRunner.over(sim.model, 32, 128, inv)
    cal = tok(load_corpus("default", "calib", nchars=3000))["input_ids"]

    def calibrate(_m: torch.nn.Module, _: object) -> None:
        for i in range(0, 256, 128):
            q.score(cal[i:i + 128], decode_tokens=4)

    sim.compute_encodings(calibrate, None)
    ids = tok(load_corpus("default", nchars=2500))["input_ids"]

    res = compare(ids, partial(fp.score, decode_tokens=8), partial(q.score, decode_tokens=8), window=128)
    assert res.test_ppl / res.ref_ppl == pytest.approx(1.0, abs=0.05)
    assert res.top1_agreement > 0.8

    # the quantize stage runs aimet's per-tensor and per-channel (the weights: not folded here) fake quantization
    # as plain tensor ops: the same logits, bit for bit
    from npustudio.core.quantize.fast_qdq import fast_fake_quantize

    aimet_logits = q.score(ids[:100], decode_tokens=4)
    with fast_fake_quantize():
        fast_logits = q.score(ids[:100], decode_tokens=4)
    assert torch.equal(aimet_logits, fast_logits)

    # and evaluates the calibrated quantsim with each encoding computed once (aimet's fast path): the same logits,
    # and the quantsim as it was afterwards
    from npustudio.core.quantize import simulate

    params = {k: v.clone() for k, v in sim.model.named_parameters()}
    with simulate.frozen(sim.model):
        frozen_logits = q.score(ids[:100], decode_tokens=4)
    assert torch.equal(aimet_logits, frozen_logits)
    assert torch.equal(q.score(ids[:100], decode_tokens=4), aimet_logits)
    after = dict(sim.model.named_parameters())
    assert after.keys() == params.keys() and all(torch.equal(after[k], v) for k, v in params.items())


def test_plain_op_fake_quantization_equals_torchs_kernel_ties_included() -> None:
    from npustudio.core.quantize.fast_qdq import per_channel_qdq, per_tensor_qdq

    g = torch.Generator().manual_seed(0)
    for qmin, qmax in ((0, 65535), (0, 255), (-128, 127), (0, 15)):
        for scale in (3.1e-6, 0.00731, 0.5, 7.0):
            s = torch.tensor(scale)
            zp = torch.tensor((qmin + qmax) // 3, dtype=torch.int32)
            k = torch.arange(qmin - 4, qmax + 5, max(1, (qmax - qmin) // 4000)).float() - zp
            x = torch.cat([torch.randn(50_000, generator=g) * scale * (qmax - qmin) / 4,
                           (k + 0.5) * s, k * s, torch.tensor([0.0, 1e30, -1e30])])  # ties, the grid, far out
            want = torch.fake_quantize_per_tensor_affine(x, s, zp, qmin, qmax)
            assert torch.equal(per_tensor_qdq(x, s, zp, qmin, qmax), want), (qmin, qmax, scale)
        # per channel, along either axis of a weight: each channel its own scale and zero point (far out here is
        # a thousand ranges away: the kernel's int64 cast overflows beyond 2^63 steps, a weight never is)
        scales = torch.tensor([3.1e-6, 0.00731, 0.5, 7.0])
        zps = torch.tensor([0, (qmin + qmax) // 3, qmax // 2, qmin], dtype=torch.int32)
        k = torch.arange(qmin - 4, qmax + 5, max(1, (qmax - qmin) // 2000)).float()
        x = torch.stack([torch.cat([torch.randn(20_000, generator=g) * sc * (qmax - qmin) / 4,
                                    (k - z + 0.5) * sc, (k - z) * sc,
                                    torch.tensor([0.0, 1e3, -1e3]) * sc * (qmax - qmin)])
                         for sc, z in zip(scales.tolist(), zps.tolist(), strict=True)])
        for axis, t in ((0, x), (1, x.t().contiguous())):
            want = torch.fake_quantize_per_channel_affine(t, scales, zps, axis, qmin, qmax)
            assert torch.equal(per_channel_qdq(t, scales, zps, axis, qmin, qmax), want), (qmin, qmax, axis)


def _adascale_quantizer(out_c: int, in_c: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """AdaScale's quantizer for an LPBQ conv weight (blocks of 64), its scales moved off their start."""
    from npustudio.core.quantize import aimet_ops
    from npustudio.core.quantize.adascale import _aimet_adascale
    from npustudio.core.quantize.simulate import weight_quantizer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_c, in_c, 1, 1, generator=g) * 0.02
    q = weight_quantizer(w, 4, 64)
    with torch.no_grad():
        m = w.abs().reshape(out_c, -1, 64).amax(-1).reshape(q.shape)
        q.set_range(-m, m)
    aq = _aimet_adascale()._get_adascale_qdq_mapping()[aimet_ops.QuantizedConv1x1](q, w.shape)
    with torch.no_grad():
        for p in aq.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.05, generator=g)
    return aq, w


def test_a_learners_compiled_quantizer_gives_eagers_numbers_and_falls_back_without_a_compiler(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """AdaScale's weight quantizer runs through torch.compile: the same weights and gradients to float rounding
    (the fused kernel's exp and divisions may differ from eager's by an ulp), with and without autograd; where
    compiling fails, every call runs eager and the log says so."""
    from aimet_torch.adascale.adascale_quantizer import AdaScaleConv2dQuantizeDequantize as Eager

    from npustudio.core.quantize import layer_training

    caplog.set_level("WARNING")
    for out_c, in_c in ((96, 128), (128, 192), (96, 128)):  # the third shares the first's graph
        caplog.clear()
        aq, w = _adascale_quantizer(out_c, in_c)
        learned = [p for p in aq.parameters() if p.requires_grad]
        want = Eager.forward(aq, w)
        want_grads = torch.autograd.grad(want.square().sum(), learned, allow_unused=True)
        got = aq(w)
        assert "_compiled_forward" in aq.__dict__
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        grads = torch.autograd.grad(got.square().sum(), learned, allow_unused=True)
        assert [g is None for g in grads] == [g is None for g in want_grads]
        assert any(g is not None and g.abs().sum() > 0 for g in grads)
        for g, h in zip(grads, want_grads, strict=True):
            if g is not None:
                torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-9)
        with torch.no_grad():
            torch.testing.assert_close(aq(w), want, rtol=1e-5, atol=1e-7)
        if shutil.which("g++"):  # the C++ compiler torch's CPU backend builds with: it compiled
            assert "torch.compile failed" not in caplog.text

    def no_compiler(fn: object, **_: object) -> object:
        def fails(*a: object) -> object:
            raise RuntimeError("Compiler: cc not found")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    forward = layer_training.compiled_forward(Eager.forward)
    aq, w = _adascale_quantizer(96, 128)
    with caplog.at_level("WARNING"):
        assert torch.equal(forward(aq, w), Eager.forward(aq, w))
        assert torch.equal(forward(aq, w), Eager.forward(aq, w))
    assert [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()] == [
        "torch.compile failed (RuntimeError: Compiler: cc not found); the learners' quantizers run eager (slower)"]
