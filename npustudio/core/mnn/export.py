"""The float model as MNN's exporter reads it, and the exporter run in a child process.

The exporter gets a folder of the float model holding only what describes it: config, safetensors weights and
tokenizer files (links to the user's files; a GGUF is dequantized into one). No Python file and no `auto_map` is
passed on, so the exporter, which loads with `trust_remote_code=True`, finds no model code to run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import layout
from ..errors import UserError
from ..forked import child_env
from ..fsutil import atomic_write_json, sha256_file
from ..progress import StateLike
from ..stage_options import Sampler

# what of a Hugging Face folder describes the model (never pickles, never code)
FLOAT_FILES = ("*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
               "generation_config.json", "added_tokens.json")
# config keys the exporter must not act on: model code from elsewhere, and a quantization already applied; in the
# files that may hold them (copied without them, not linked)
DROPPED_KEYS = ("auto_map", "quantization_config")
CLEANED = ("config.json", "tokenizer_config.json")
# the exporter's steps, as its log announces them when each is done, and the share of the time they end at
STEPS = (("load pretrained model", 0.1), ("export onnx model", 0.45), ("convert onnx model", 0.6),
         ("quant model weight", 0.9), ("export tokenizer", 0.95), ("export config", 1.0))
DEBRIS = ("onnx", "llm.mnn.json")  # the intermediate ONNX and a JSON dump of the graph: not part of the model
CONVERTER_LOG = ".export.log"  # MNN's converter's output, in the working folder (its figures are in ours)
_POLL_S = 0.2


def write_float_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    """A loaded (dequantized) model as a safetensors folder: what a GGUF source gives the exporter."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(folder))
    config = model.config.to_dict()
    _write_config(config, folder)


def link_float_folder(source: Path, folder: Path) -> None:
    """A Hugging Face folder's describing files, linked (not copied) into `folder`; its config and tokenizer
    config copied without what names code to run."""
    folder.mkdir(parents=True, exist_ok=True)
    for pattern in FLOAT_FILES:
        for f in source.glob(pattern):
            if f.is_file() and f.name not in CLEANED:
                (folder / f.name).symlink_to(f.resolve())
    for name in CLEANED:
        if (source / name).is_file():
            _write_config(json.loads((source / name).read_text()), folder, name)


def _write_config(config: dict[str, Any], folder: Path, name: str = "config.json") -> None:
    for key in DROPPED_KEYS:
        config.pop(key, None)
    atomic_write_json(folder / name, config)


def export(float_dir: Path, out: Path, bits: int, block: int, lm_head_bits: int, state: StateLike,
           method: str = "plain") -> Path:
    """MNN's exporter on `float_dir`, writing the MNN model into `out`; its log beside it. A stop kills it."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args = ["--path", str(float_dir.resolve()), "--export", "mnn", "--dst_path", str(out), "--quant_bit", str(bits),
            "--quant_block", str(block), "--lm_quant_bit", str(lm_head_bits),
            "--lm_quant_block", str(0 if lm_head_bits == 8 else block), "--mnnconvert", str(out / "no-binary")]
    if method == "hqq":
        args.append("--hqq")
    log = out.parent / "llmexport.log"  # in the stage's folder: kept with the model, gone with a failed stage
    with open(log, "wb") as sink:
        # in the stage's folder: MNN's converter writes its own log (.export.log) into the working folder
        proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.llmexport_child", *args], cwd=out.parent,
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=child_env())
        try:
            done = 0.0
            while proc.poll() is None:
                state.check()
                text = log.read_bytes().decode(errors="replace")
                for step, at in STEPS:
                    if at > done and f"Done {step}" in text:
                        done = at
                        state.progress(done, f"MNN export: {step} done")
                time.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or not (out / "llm.mnn").is_file():
        lines = [ln for ln in log.read_bytes().decode(errors="replace").splitlines() if ln.strip()]
        raise UserError(f"MNN's exporter could not export the model (exit {proc.returncode}): "
                        + " | ".join(lines[-12:])[-1500:],
                        "MNN's exporter takes the model families its authors list (llmexport); use the ort-qnn "
                        "back-end for the others.")
    for p in [out / name for name in DEBRIS] + [out.parent / CONVERTER_LOG]:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return out


def write_sampler(folder: Path, sampler: Sampler) -> None:
    """How MNN's runtime picks tokens, into the model's config.json (the exporter writes a random sampler there):
    greedy, or Genie's top-k, top-p and temperature, in both spellings MNN versions read (MNN has no seed)."""
    config = json.loads((folder / layout.MNN_CONFIG).read_text(encoding="utf-8"))
    if sampler.greedy:
        config["sampler_type"] = "greedy"
    else:
        config |= {"sampler_type": "mixed", "mixed_samplers": ["topK", "topP", "temperature"],
                   "temperature": sampler.temp, "topK": sampler.top_k, "top_k": sampler.top_k,
                   "topP": sampler.top_p, "top_p": sampler.top_p}
    atomic_write_json(folder / layout.MNN_CONFIG, config)


def versions() -> str:
    return f"llmexport {metadata.version('llmexport')}, MNN {metadata.version('MNN')}"


def model_files(folder: Path) -> list[dict[str, Any]]:
    """The model's files as the stage made them: what deploy checks the folder against before it pushes."""
    return [{"file": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(folder.iterdir())
            if f.is_file()]

