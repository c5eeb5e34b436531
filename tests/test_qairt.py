"""The qairt back-end's command lines, configs and result parsing, against stand-in SDK executables.

The QAIRT SDK is not on this machine: these stand-ins record their arguments and write the files the
real tools would, so what is tested is our side (the invocations, the configs, the checks), not QNN.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from npustudio.core.compile import CompileOptions, qairt
from npustudio.core.compile import run as compile_run
from npustudio.core.errors import UserError
from npustudio.core.progress import State
from npustudio.core.project import Project

GRAPHS = ["prompt_ar32_cl128_1_of_1", "token_ar1_cl128_1_of_1"]

STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$(dirname "$0")/calls.log"
case "$(basename "$0")" in
  qairt-converter|qairt-quantizer)
    while [ $# -gt 0 ]; do case "$1" in --output_path|--output_dlc) touch "$2";; esac; shift; done ;;
  qnn-context-binary-generator)
    while [ $# -gt 0 ]; do case "$1" in --binary_file) b=$2;; --output_dir) o=$2;; esac; shift; done
    [ -n "$FAIL_GENERATOR" ] && { echo "ERROR: could not create op Foo (1002)" >&2; exit 3; }
    head -c 4096 /dev/zero > "$o/$b.bin" ;;
  qnn-context-binary-utility)
    while [ $# -gt 0 ]; do case "$1" in --json_file) j=$2;; esac; shift; done
    cat "$(dirname "$0")/utility.json" > "$j" ;;
esac
"""


def _utility_json(ar_prompt: int = 32) -> dict[str, object]:
    def graph(name: str, ar: int) -> dict[str, object]:
        return {"info": {"graphName": name, "graphInputs": [
            {"info": {"name": "input_ids", "dimensions": [1, ar]}},
            {"info": {"name": "attention_mask", "dimensions": [1, 1, ar, 128]}}], "graphOutputs": []}}
    return {"info": {"dspArch": "v79", "graphs": [graph(GRAPHS[0], ar_prompt), graph(GRAPHS[1], 1)]}}


@pytest.fixture
def sdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "qairt" / "2.37.0.250724"
    bins = root / "bin" / qairt.HOST
    bins.mkdir(parents=True)
    (root / "sdk.yaml").write_text("name: qairt\nversion: 2.37.0.250724\n")
    for t in ("qairt-converter", "qairt-quantizer", "qnn-context-binary-generator", "qnn-context-binary-utility"):
        (bins / t).write_text(STAND_IN)
        (bins / t).chmod(0o755)
    (bins / "utility.json").write_text(json.dumps(_utility_json()))
    monkeypatch.setenv("QNN_SDK_ROOT", str(root))
    return root


def test_without_the_sdk_the_user_is_told_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    with pytest.raises(UserError) as e:
        qairt.sdk_root()
    assert "QNN_SDK_ROOT is not set" in e.value.problem and "ort-qnn" in e.value.fix


def test_a_known_bad_sdk_is_refused_and_an_old_phone_runtime_warned() -> None:
    with pytest.raises(UserError) as e:
        qairt.check_version("2.38.0.250901")
    assert "known Genie issue" in e.value.problem
    assert qairt.check_version("2.37.0", phone_runtime="2.37.1") == []
    assert "error 5000" in qairt.check_version("2.37.0", phone_runtime="2.31.0")[0]


def test_the_sdk_chain_runs_with_the_aimet_encodings_and_weight_sharing(sdk: Path, genie_project: Project,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    q = genie_project.stage_dir("quantize")
    res = compile_run(q, genie_project.stage_dir("adapt"), CompileOptions(backend="qairt"), out, State())
    calls = (sdk / "bin" / qairt.HOST / "calls.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["qairt-converter", "qairt-quantizer"] * 2 + [
        "qnn-context-binary-generator", "qnn-context-binary-utility"]
    assert f"--quantization_overrides {q / GRAPHS[0]}.encodings" in calls[0]
    gen = calls[4]
    assert f"--dlc_path {out / GRAPHS[0]}_q.dlc,{out / GRAPHS[1]}_q.dlc" in gen and "--binary_file model_1_of_1" in gen
    backend_cfg = json.loads((out / "htp_backend_config.json").read_text())
    assert backend_cfg["graphs"][0]["graph_names"] == GRAPHS
    assert backend_cfg["devices"] == [{"dsp_arch": "v79", "soc_model": 69}]
    assert backend_cfg["context"]["weight_sharing_enabled"] is True
    assert res.backend == "qairt" and res.nodes_on_cpu == 0
    found = res.verification.model_extra or {}
    assert found["sdk_version"] == "2.37.0.250724"
    assert found["binary_check"]["graphs"] == GRAPHS
    assert "not run" in (res.verification.simulator or "")  # never pretends to have verified on the simulator
    assert res.io["past_key_0_in"].dtype == "uint8" and res.io["logits"].dtype == "uint16"


def test_a_binary_with_the_wrong_ar_is_caught(sdk: Path, genie_project: Project, tmp_path: Path) -> None:
    (sdk / "bin" / qairt.HOST / "utility.json").write_text(json.dumps(_utility_json(ar_prompt=64)))
    with pytest.raises(UserError) as e:
        compile_run(genie_project.stage_dir("quantize"), genie_project.stage_dir("adapt"),
                    CompileOptions(backend="qairt"), tmp_path, State())
    assert "expected AR 32 and CL 128" in e.value.problem


def test_a_failing_tool_shows_its_own_message(sdk: Path, genie_project: Project, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "FAIL_GENERATOR", "1")
    with pytest.raises(UserError) as e:
        compile_run(genie_project.stage_dir("quantize"), genie_project.stage_dir("adapt"),
                    CompileOptions(backend="qairt"), tmp_path, State())
    assert "qnn-context-binary-generator failed (exit 3)" in e.value.problem
    assert "could not create op Foo (1002)" in e.value.problem
