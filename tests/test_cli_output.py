"""What the CLI prints where there is no terminal (a CI log, a pipe): our lines whole, no other library's noise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from npustudio.core.project import Project
from npustudio.display import human_number
from tests.conftest import subcommands


def test_a_stage_run_into_a_pipe_prints_whole_lines_and_no_library_warnings(genie_project: Project,
                                                                            tmp_path: Path) -> None:
    root = tmp_path / "p"
    shutil.copytree(genie_project.root, root)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NPUSTUDIO_DEBUG")}
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "quantize", "--project", str(root), "--force",
                          "--calib-samples", "2", "--calib-len", "64"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr
    for noise in ("Warning", "warnings.warn", "it/s]", "Traceback"):
        assert noise not in res.stderr + res.stdout, res.stderr
    # the summary line is longer than the 80 columns rich assumes without a terminal, and stays one line
    line = next(s for s in res.stdout.splitlines() if s.startswith("Quantized w8a16"))
    assert len(line) > 80 and line.rstrip().endswith("tokens"), res.stdout


def test_measured_figures_are_rounded_for_people() -> None:
    assert human_number(None) == "—"  # a figure the profile lacks, not a crash
    assert [human_number(x) for x in (157.0962, 38.211692810058594, 0.81134, 12345.6, 0.0)] == \
        ["157", "38.2", "0.811", "12,346", "0"]


def test_cli_defaults_come_from_the_stage_options_and_the_windows_settings() -> None:
    """A default lives in the stage's options model (the CLI follows it); the precision, target and device the
    window's settings name are the CLI's defaults too; a flag given on the command line wins."""
    from npustudio.cli import build_parser
    from npustudio.core import settings
    from npustudio.core.quantize import QuantizeOptions

    p = build_parser()
    a = p.parse_args(["quantize", "--project", "p"])
    want = QuantizeOptions()
    assert (a.precision, a.target, a.calib_samples, a.calib_len) == \
        (want.precision, want.target, want.calib_samples, want.calib_len)
    helps = {x.dest: x.help for x in subcommands(p)["quantize"]._actions}
    assert helps["calib_samples"] == QuantizeOptions.model_fields["calib_samples"].description
    prefs = settings.load()
    prefs.default_precision, prefs.default_target, prefs.device = "w4a16", "SM8650", "cpu"
    settings.save(prefs)
    a = build_parser().parse_args(["run", "--no-ask"])
    assert (a.precision, a.target, a.device) == ("w4a16", "SM8650", "cpu")
    a = build_parser().parse_args(["quantize", "--project", "p", "--precision", "w8a16"])
    assert a.precision == "w8a16"


def test_bars_that_call_tqdm_directly_stay_out_of_a_pipe() -> None:
    """transformers' GGUF loader (the default model) draws its own tqdm bar, one redraw per tensor; the CLI imports
    torch (which imports tqdm) before it silences anything, so tqdm has read its environment by then."""
    code = ("import npustudio.cli.main, torch\n"
            "from npustudio.core import quiet; quiet.libraries()\n"
            "from tqdm.auto import tqdm\n"
            "for _ in tqdm(range(50), desc='Converting and de-quantizing GGUF tensors...'): pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_") and k != "NPUSTUDIO_DEBUG"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "GGUF" not in res.stderr + res.stdout


def test_a_table_into_a_pipe_keeps_each_row_on_one_line(tmp_path: Path) -> None:
    """Without a terminal rich assumed 80 columns and broke cells mid-word ("kv-c" / "ache") over several lines."""
    import json

    name = "/layers.0/attn/k_cat/Concat_output_0"
    f = tmp_path / "m.encodings"
    f.write_text(json.dumps({"version": "1.0.0", "activation_encodings": [
        {"name": name, "dtype": "INT", "bw": 8, "is_sym": False, "scale": [0.0276], "offset": [-128],
         "enc_type": "PER_TENSOR"},
        {"name": "past_key_0_out", "dtype": "INT", "bw": 8, "is_sym": False, "scale": [0.0276], "offset": [-128],
         "enc_type": "PER_TENSOR"}], "param_encodings": []}))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NPUSTUDIO_DEBUG")}
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "encodings", str(f)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    row = next(s for s in res.stdout.splitlines() if name in s)
    assert "kv-cache" in row and "activation" in row and "[-3.533, 3.505]" in row, res.stdout
