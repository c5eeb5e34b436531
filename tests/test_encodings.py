"""The encodings reader: both schemas, the per-tensor numbers, flags, and clear errors on bad files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from npustudio.core.errors import UserError
from npustudio.core.graph import encodings


def _v1(tmp_path: Path, acts: list[dict], params: list[dict]) -> Path:
    f = tmp_path / "m.encodings"
    f.write_text(json.dumps({"version": "1.0.0", "producer": {"name": "x"}, "activation_encodings": acts,
                             "param_encodings": params, "excluded_layers": [], "quantizer_args": {}}))
    return f


def _act(name: str, scale: float, bw: int = 16, offset: int = -32768) -> dict:
    return {"name": name, "dtype": "INT", "bw": bw, "is_sym": False, "scale": [scale], "offset": [offset],
            "enc_type": "PER_TENSOR"}


def test_v1_rows_roles_layers_ranges_and_flags(tmp_path: Path) -> None:
    acts = [_act(f"/layers.{i}/mlp/down/Conv_output_0", 0.01 if i != 2 else 0.5) for i in range(4)]
    acts.append(_act("past_key_3_in", 0.02, bw=8, offset=-128))
    params = [
        {"name": "layers.0.attn.q.0.weight", "dtype": "INT", "bw": 8, "is_sym": True, "scale": [0.001, 0.5],
         "offset": [-128, -128], "enc_type": "PER_CHANNEL"},
        {"name": "layers.1.mlp.down.weight", "dtype": "INT", "bw": 8, "is_sym": True, "scale": [0.01, 0.02],
         "offset": [-128, -128], "enc_type": "LPBQ", "block_size": 64, "compressed_bw": 4,
         "per_block_int_scale": [16, 8, 4, 16]},
        {"name": "lm_head.weight", "dtype": "INT", "bw": 8, "is_sym": True, "scale": [0.1], "offset": [-128],
         "enc_type": "PER_CHANNEL"},
    ]
    t = encodings.read(_v1(tmp_path, acts, params))
    q = t.by_name("layers.0.attn.q.0.weight")
    assert (q.layer, q.role, q.kind, q.bitwidth, q.granularity, q.channels) == (0, "q", "param", 8, "channel", 2)
    assert q.scale_spread == pytest.approx(500) and q.flags  # spread flagged
    assert q.range_min == pytest.approx(-128 * 0.5) and q.range_max == pytest.approx(127 * 0.5)
    d = t.by_name("layers.1.mlp.down.weight")
    assert (d.bitwidth, d.granularity, d.block_size, d.role) == (4, "block", 64, "down")
    assert d.scale_min == pytest.approx(0.01 * 8) and d.scale_max == pytest.approx(0.02 * 16)
    kv = t.by_name("past_key_3_in")
    assert (kv.role, kv.layer, kv.bitwidth) == ("kv-cache", 3, 8)
    assert kv.range_min == pytest.approx(-128 * 0.02) and kv.range_max == pytest.approx(127 * 0.02)
    wide = t.by_name("/layers.2/mlp/down/Conv_output_0")
    assert wide.flags and "wider" in wide.flags[0]
    assert not t.by_name("/layers.1/mlp/down/Conv_output_0").flags
    assert t.by_name("lm_head.weight").role == "lm_head"
    assert {s.layer for s in t.layers} == {0, 1, 2, 3, None}
    assert next(s for s in t.layers if s.layer == 2).flagged == 1


def test_legacy_0_6_1_dict_form(tmp_path: Path) -> None:
    f = tmp_path / "legacy.encodings"
    ch = [{"bitwidth": 8, "dtype": "int", "is_symmetric": "True", "max": 0.127 * k, "min": -0.128 * k,
           "offset": -128, "scale": 0.001 * k} for k in (1, 2, 3)]
    f.write_text(json.dumps({"version": "0.6.1", "activation_encodings": {"/embed/Gather_output_0": [
        {"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "max": 1.0, "min": -1.0, "offset": -32768,
         "scale": 2 / 65535}]}, "param_encodings": {"layers.3.mlp.up.weight": ch}}))
    t = encodings.read(f)
    up = t.by_name("layers.3.mlp.up.weight")
    assert (up.layer, up.role, up.bitwidth, up.symmetric, up.granularity, up.channels) == (3, "up", 8, True,
                                                                                          "channel", 3)
    assert up.scale_median == pytest.approx(0.002)
    g = t.by_name("/embed/Gather_output_0")
    assert (g.kind, g.bitwidth, g.granularity, g.role) == ("activation", 16, "tensor", "embedding")
    assert g.range_min == pytest.approx(-1.0, rel=1e-3) and g.range_max == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(("content", "message"), [
    ("", "not valid JSON"),
    ("[1, 2]", "not an encodings file"),
    ('{"version": "1.0.0", "activation_encodings": 5, "param_encodings": []}', "section is malformed"),
    ('{"version": "1.0.0", "activation_encodings": [{"bw": 8}], "param_encodings": []}', "entry without a name"),
    ('{"version": "1.0.0", "activation_encodings": [{"name": "x", "bw": 8}], "param_encodings": []}',
     "encoding of 'x' is malformed"),
    ('{"version": "1.0.0", "activation_encodings": [{"name": "x", "bw": "eight", "scale": [1], "offset": [0]}], '
     '"param_encodings": []}', "encoding of 'x' is malformed"),
    ('{"version": "1.0.0", "activation_encodings": [{"name": "x", "bw": 8, "scale": [1], "offset": [0], '
     '"enc_type": "PER_GALAXY"}], "param_encodings": []}', "unknown enc_type"),
    ('{"activation_encodings": {"t": ["a"]}, "param_encodings": {}}', "malformed"),
])
def test_malformed_files_give_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "bad.encodings"
    f.write_text(content)
    with pytest.raises(UserError, match=message) as e:
        encodings.read(f)
    assert "encodings file" in e.value.fix


def test_cli_reports_errors_and_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from npustudio.cli import main

    assert main(["encodings", str(tmp_path / "missing.encodings")]) == 2
    assert "No encodings file" in capsys.readouterr().err
    f = _v1(tmp_path, [_act("past_value_0_out", 0.02, bw=8, offset=-128)], [])
    assert main(["encodings", str(f), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["role"] == "kv-cache" and rows[0]["bitwidth"] == 8
    assert main(["encodings", str(f)]) == 0
    assert "past_value_0_out" in capsys.readouterr().out


def test_sqnr_measures_each_weight_on_the_grid_the_export_wrote(genie_project: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`npustudio encodings FILE --sqnr`: the error of each quantized weight against the adapted float weights, on
    exactly the grid the QDQ graph holds (recomputed here from that graph's integers and scales)."""
    import math
    import shutil

    import numpy as np
    import onnx
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    from npustudio.cli import main

    q = genie_project.stage_dir("quantize")
    enc = next(q.glob("prompt_*.encodings"))
    assert main(["encodings", str(enc), "--sqnr", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    weights = {n: r for n, r in rows.items() if r["kind"] == "param"}
    assert weights and all(r["sqnr_db"] is not None for r in weights.values())
    acts = {n: r for n, r in rows.items() if r["kind"] == "activation" and r["sqnr_db"] is not None}
    # every activation the step fed real values through has a figure (the prompt step's KV-cache inputs are empty)
    assert {n for n, r in rows.items() if r["kind"] == "activation" and r["sqnr_db"] is None} == \
        {n for n in rows if re.fullmatch(r"past_(key|value)_\d+_in", n)}
    # the 8-bit KV cache loses far more than the 16-bit activations: about 6 dB a bit
    kv8 = [r["sqnr_db"] for r in acts.values() if r["bitwidth"] == 8]
    a16 = [r["sqnr_db"] for r in acts.values() if r["bitwidth"] == 16]
    assert kv8 and a16 and max(kv8) + 30 < min(a16) and all(30 < db < 55 for db in kv8)
    assert weights["embed.weight"]["sqnr_db"] > weights["layers.0.mlp.down.weight"]["sqnr_db"] + 30  # 16 vs 8 bits

    floats = load_file(str(genie_project.stage_dir("adapt") / "decoder.safetensors"))
    qdq = onnx.load(str(enc.with_name(enc.stem + "_qdq.onnx")), load_external_data=False)
    name = "layers.0.mlp.down.weight"

    def array(t: Any) -> np.ndarray:  # read by hand: onnx refuses weights.bin, hard-linked by the compile stage
        if not onnx.external_data_helper.uses_external_data(t):
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        data = (q / info["location"]).read_bytes()[int(info["offset"]):int(info["offset"]) + int(info["length"])]
        return np.frombuffer(data, dtype=dtype).reshape(tuple(t.dims))

    init = {t.name: array(t) for t in qdq.graph.initializer if t.name.startswith(name)}
    w = floats[name].astype(np.float64)
    deq = (init[f"{name}_q"].astype(np.float64) - init[f"{name}_zero_point"].reshape(-1, 1, 1, 1)) * \
        init[f"{name}_scale"].astype(np.float64).reshape(-1, 1, 1, 1)
    expected = 10 * math.log10(np.sum(w * w) / np.sum((w - deq) ** 2))
    assert weights[name]["sqnr_db"] == pytest.approx(expected, abs=1e-3)

    alone = tmp_path / enc.name  # outside a project: no float weights to compare with
    shutil.copy(enc, alone)
    assert main(["encodings", str(alone), "--sqnr"]) == 2
    assert "needs the float weights" in capsys.readouterr().err
