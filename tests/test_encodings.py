"""The encodings reader: both schemas, the per-tensor numbers, flags, and clear errors on bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npustudio.core.errors import UserError
from npustudio.core.quantize import encodings


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
