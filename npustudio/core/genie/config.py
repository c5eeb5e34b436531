"""genie_config.json, htp_backend_ext_config.json and the sample prompt, from the architecture card.

Formats: `reference/genie-qnn-formats.md` and Genie's own JSON schemas (basic dialog, QnnHtp engine,
binary model with rope positional encoding). Paths inside the config are relative to the bundle
folder, as genie-t2t-run on a phone runs from there; `absolute()` resolves them for the desktop.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..targets import Soc

CONFIG = "genie_config.json"
HTP_EXT = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"


class Sampler(BaseModel):
    greedy: bool = Field(True, description="deterministic: the same answer on the phone, simulator and preview")
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 42


def rope(card: dict[str, Any]) -> dict[str, Any]:
    enc: dict[str, Any] = {"type": "rope", "rope-dim": card["head_dim"] // 2, "rope-theta": card["rope_theta"]}
    sc = card.get("rope_scaling") or {}
    kind = sc.get("rope_type") or sc.get("type")
    if kind == "llama3":
        enc["rope-scaling"] = {"rope-type": "llama3", "factor": sc["factor"],
                               "low-freq-factor": sc.get("low_freq_factor", 1.0),
                               "high-freq-factor": sc.get("high_freq_factor", 4.0),
                               "original-max-position-embeddings": sc.get("original_max_position_embeddings", 8192)}
    return enc


def genie_config(card: dict[str, Any], cl: int, ctx_bins: list[str], sampler: Sampler, n_threads: int = 2,
                 htp_ext: bool = False) -> dict[str, Any]:
    eos = card["eos_ids"]
    qnn = {"version": 1, "use-mmap": False, "spill-fill-bufsize": 0, "mmap-budget": 0, "poll": False,
           "cpu-mask": "0x3", "kv-dim": card["head_dim"], "allow-async-init": False}
    backend: dict[str, Any] = {"version": 1, "type": "QnnHtp", "QnnHtp": qnn}
    if htp_ext:
        backend["extensions"] = HTP_EXT
    samp: dict[str, Any] = {"version": 1, "seed": sampler.seed, "temp": sampler.temp, "top-k": sampler.top_k,
                            "top-p": sampler.top_p}
    if sampler.greedy:  # Genie samples from top-k unless k is 1
        samp.update({"greedy": True, "top-k": 1})
    return {"dialog": {
        "version": 1, "type": "basic",
        "context": {"version": 1, "size": cl, "n-vocab": card["vocab"], "bos-token": card["bos_id"],
                    "eos-token": eos[0] if len(eos) == 1 else eos},
        "sampler": samp,
        "tokenizer": {"version": 1, "path": TOKENIZER},
        "engine": {"version": 1, "n-threads": n_threads, "backend": backend,
                   "model": {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": ctx_bins},
                             "positional-encoding": rope(card)}}}}


def htp_ext_config(target: Soc, weight_sharing: bool) -> dict[str, Any]:
    return {"devices": [{"soc_model": target.soc_model, "dsp_arch": target.dsp_arch,
                         "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": weight_sharing}}


def absolute(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The config with its file paths resolved against `folder` (the bundle), for a desktop run."""
    c = copy.deepcopy(config)
    d = c["dialog"]
    d["tokenizer"]["path"] = str((folder / d["tokenizer"]["path"]).resolve())
    binary = d["engine"]["model"]["binary"]
    binary["ctx-bins"] = [str((folder / b).resolve()) for b in binary["ctx-bins"]]
    backend = d["engine"]["backend"]
    if "extensions" in backend:
        backend["extensions"] = str((folder / backend["extensions"]).resolve())
    return c


def read(path: Path) -> dict[str, Any]:
    from ..errors import UserError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"No Genie config at {path}.", "Pass the genie_config.json of a bundle "
                        "(`npustudio bundle` writes one).") from e
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}.", "Rebuild the bundle with `npustudio bundle`.") from e
    if not isinstance(data, dict) or "dialog" not in data:
        raise UserError(f"{path} has no 'dialog' section.", "Pass a Genie dialog config (genie_config.json).")
    return data


def chat_prompt(tokenizer: Any, user: str, system: str | None = None, history: list[dict[str, str]] | None = None,
                bos_added_by_runtime: bool = True) -> str:
    """The model's chat template applied (real newlines), without the BOS Genie prepends itself."""
    msgs = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    msgs.append({"role": "user", "content": user})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos_added_by_runtime and bos and text.startswith(bos):
        text = text[len(bos):]
    return text
