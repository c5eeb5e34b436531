"""One bundle for Genie and GenieX: GenieX's own model-spec loader (built from its public sources by
tests/geniex/build.sh) must accept NPU Studio's bundles and refuse damaged ones as GenieX does.

GenieX's sources (BSD-3) are not part of this tree: set GENIEX_SRC to a folder holding checkouts of
geniex-qairt-plugin, geniex-proc, xtensor and xtl (see build.sh). Without it the harness tests are skipped, and
the bundle's GenieX metadata is still checked against the compiled graphs in tests/test_families.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from npustudio.core import layout, stages
from npustudio.core.project import Project
from tests.conftest import done, genie_pipeline, make_tiny_model

SRC = os.environ.get("GENIEX_SRC")
needs_geniex = pytest.mark.skipif(not SRC, reason="GenieX's sources are not here: set GENIEX_SRC (tests/geniex)")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("geniex")
    build = subprocess.run(["bash", str(Path(__file__).parent / "geniex" / "build.sh"), str(SRC), str(out)],
                           capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stderr[-3000:]
    return out / "harness"


def _load(harness: Path, bundle: Path) -> dict[str, Any]:
    res = subprocess.run([str(harness), str(bundle)], capture_output=True, text=True, timeout=120)
    out = json.loads(res.stdout)
    assert (res.returncode == 0) == ("error" not in out), res
    return out


def _copy(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to, copy_function=os.link)
    (to / layout.METADATA).unlink()
    shutil.copy2(bundle / layout.METADATA, to / layout.METADATA)  # edited below: not the original's inode
    return to


@needs_geniex
def test_geniex_loads_a_tiny_llama_and_qwen3_bundle_with_their_shapes(harness: Path, genie_project: Project,
                                                                       tmp_path: Path) -> None:
    """GenieX's loader reads our metadata.json as the model we compiled: its pipeline (model_id), one shard,
    the hidden size, KV heads, head size, vocabulary and layers of the card, the binaries genie_config.json
    names."""
    qwen3 = genie_pipeline(tmp_path / "qwen3", make_tiny_model(tmp_path / "q3", "qwen3"))
    for project, prefix in ((genie_project, "llama_v3_"), (qwen3, "qwen3_")):
        card = done(project, stages.MODEL).result.card
        got = _load(harness, project.stage_dir("bundle"))
        assert got["model_id"].startswith(prefix), got
        assert (got["shards"], got["num_kv_heads"], got["head_dim"], got["vocab_size"], got["num_hidden_layers"]) \
            == (1, card.kv_heads, card.head_dim, card.vocab, card.layers), (got, card)
        assert got["first_input"] in ("input_ids", "inputs_embeds") and got["model_paths"] == 2


@needs_geniex
def test_geniex_refuses_a_damaged_bundle_as_geniex_does(harness: Path, genie_project: Project,
                                                        tmp_path: Path) -> None:
    bundle = genie_project.stage_dir("bundle")
    meta = json.loads((bundle / layout.METADATA).read_text())

    def damaged(name: str, edit: Any) -> dict[str, Any]:
        folder = _copy(bundle, tmp_path / name)
        m = json.loads(json.dumps(meta))
        edit(m)
        (folder / layout.METADATA).write_text(json.dumps(m))
        return _load(harness, folder)

    def first_input(m: dict[str, Any]) -> None:
        for io in m["model_files"].values():
            io["inputs"] = {("tokens" if k in ("input_ids", "inputs_embeds") else k): v
                            for k, v in io["inputs"].items()}

    cases = {"no_files": (lambda m: m.pop("model_files"), "missing 'model_files'"),
             "renamed": (lambda m: m.update(model_files={f"graph{i}": v for i, v in
                                                         enumerate(m["model_files"].values())}),
                         "no recognisable shard entries"),
             "first_input": (first_input, "unrecognised first-shard input 'tokens'")}
    for name, (edit, said) in cases.items():
        got = damaged(name, edit)
        assert said in got.get("error", ""), (name, got)
    folder = _copy(bundle, tmp_path / "no_tokenizer")
    (folder / layout.TOKENIZER).unlink()
    assert "tokenizer.json not found" in _load(harness, folder)["error"]
