"""genie_config.json, htp_backend_ext_config.json and the sample prompt, from the architecture card.

Formats: Genie's own JSON schemas (basic dialog, QnnHtp engine, binary model with rope positional encoding),
embedded in libGenie.so, which validates every bundle. Paths inside the config are relative to the bundle
folder, as genie-t2t-run on a phone runs from there; `absolute()` resolves them for the desktop.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import layout
from ..stage_options import Sampler as Sampler  # re-exported: the bundle options' sampler, declared there
from ..targets import Soc

if TYPE_CHECKING:
    from ..results import IOEncoding


def rope(card: dict[str, Any]) -> dict[str, Any]:
    """Genie's positional-encoding block: Genie computes the cos/sin tables from it, and they must equal the
    ones the host runner computes from the stored frequencies (core/config_audit.py says what was measured).
    `dynamic` stays plain RoPE: it scales nothing within max_position_embeddings, which bounds the context.
    `rope-dim` is the number of rotary frequencies (the tables' width): half the dims RoPE rotates, which with a
    partial rotary factor are the first `rotary_dim` of each head; Genie's frequencies are then
    theta^(-i/rope-dim), transformers' theta^(-2i/rotary_dim) (measured equal, tests/test_families.py)."""
    hd = card.get("rotary_dim") or card["head_dim"]
    enc: dict[str, Any] = {"type": "rope", "rope-dim": hd // 2, "rope-theta": card["rope_theta"]}
    sc = card.get("rope_scaling") or {}
    kind = sc.get("rope_type") or sc.get("type")
    if kind == "llama3":
        enc["rope-scaling"] = {"rope-type": "llama3", "factor": sc["factor"],
                               "low-freq-factor": sc.get("low_freq_factor", 1.0),
                               "high-freq-factor": sc.get("high_freq_factor", 4.0),
                               "original-max-position-embeddings": sc.get("original_max_position_embeddings", 8192)}
    elif kind == "linear":
        enc["rope-scaling"] = {"rope-type": "linear", "factor": sc["factor"]}
    elif kind == "yarn":
        f = float(sc["factor"])
        # Genie multiplies the tables by attn-factor · (1 + 0.1·ln factor); transformers by its attention factor
        enc["rope-scaling"] = {"rope-type": "yarnrope", "factor": f,
                               "original-max-position-embeddings": sc["original_max_position_embeddings"],
                               "dim": hd, "extrapolation-factor": 1.0,
                               "attn-factor": sc["attention_factor"] / (1.0 + 0.1 * math.log(f)),
                               "beta-fast": sc["beta_fast"], "beta-slow": sc["beta_slow"]}
    elif kind == "longrope":
        enc["rope-scaling"] = {"rope-type": "longrope", "factor": sc["factor"],
                               "original-max-position-embeddings": sc["original_max_position_embeddings"],
                               "short-factor": list(sc["short_factor"]), "long-factor": list(sc["long_factor"])}
    return enc


def embedding_config(lut: str, width: int, enc: IOEncoding) -> dict[str, Any]:
    """Genie's dialog `embedding` block for a lookup table of the graph input's own quantized rows: with the
    input's scale and offset (QNN's offset is minus the zero point), Genie copies each row as stored."""
    return {"version": 1, "size": width, "type": "lut", "lut-path": lut,
            "datatype": {"uint16": "ufixed16", "uint8": "ufixed8"}[enc.dtype],
            "quant-param": {"scale": enc.scale, "offset": -enc.zero_point}}


def engine_config(card: dict[str, Any], ctx_bins: list[str], n_threads: int = 2,
                  htp_ext: bool = False) -> dict[str, Any]:
    """One model's engine: its binaries on the HTP, its KV head size and RoPE (a draft model has its own)."""
    qnn = {"version": 1, "use-mmap": False, "spill-fill-bufsize": 0, "mmap-budget": 0, "poll": False,
           "cpu-mask": "0x3", "kv-dim": card["head_dim"], "allow-async-init": False}
    backend: dict[str, Any] = {"version": 1, "type": "QnnHtp", "QnnHtp": qnn}
    if htp_ext:
        backend["extensions"] = layout.HTP_EXT_CONFIG
    return {"version": 1, "n-threads": n_threads, "backend": backend,
            "model": {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": ctx_bins},
                      "positional-encoding": rope(card)}}


def dialog_config(card: dict[str, Any], cl: int, ctx_bins: list[str], sampler: Sampler, n_threads: int = 2,
                  htp_ext: bool = False, embedding: dict[str, Any] | None = None) -> dict[str, Any]:
    eos = card["eos_ids"]
    samp: dict[str, Any] = {"version": 1, "seed": sampler.seed, "temp": sampler.temp, "top-k": sampler.top_k,
                            "top-p": sampler.top_p}
    if sampler.greedy:  # Genie samples from top-k unless k is 1
        samp.update({"greedy": True, "top-k": 1})
    dialog = {
        "version": 1, "type": "basic",
        "context": {"version": 1, "size": cl, "n-vocab": card["vocab"], "bos-token": card["bos_id"],
                    "eos-token": eos[0] if len(eos) == 1 else eos},
        "sampler": samp,
        "tokenizer": {"version": 1, "path": layout.TOKENIZER},
        "engine": engine_config(card, ctx_bins, n_threads, htp_ext)}
    if embedding:
        dialog["embedding"] = embedding
    return {"dialog": dialog}


def with_lora(config: dict[str, Any], adapters: list[str], alpha: str) -> dict[str, Any]:
    """Genie's input-weight LoRA (lora-version 1) on the dialog's engine: each adapter a folder of `.raw` files, one
    per graph input holding "lora" in its name, which `GenieDialog_applyLora` quantizes into those inputs; `alpha`
    the input its strength goes to."""
    out = copy.deepcopy(config)
    out["dialog"]["engine"]["model"]["binary"]["lora"] = {
        "version": 1, "lora-version": 1, "alpha-tensor-name": alpha,
        "adapters": [{"version": 1, "name": n, "path": f"{layout.LORA_BUNDLE}/{n}", "alphas": [alpha]}
                     for n in adapters]}
    return out


def speculative(config: dict[str, Any], draft_engine: dict[str, Any], draft_len: int) -> dict[str, Any]:
    """A basic dialog turned into Genie's draft-model dialog (`spd`): the draft proposes `draft_len` tokens, the
    target checks them in one call and keeps those it would have chosen (with greedy sampling, the same answer)."""
    out = copy.deepcopy(config)
    d = out["dialog"]
    d["type"] = "spd"
    d["spd"] = {"version": 1, "draft-len": draft_len}
    d["engine"] = [draft_engine | {"role": "draft"}, d["engine"] | {"role": "target"}]
    return out


def htp_ext_config(target: Soc, weight_sharing: bool) -> dict[str, Any]:
    return {"devices": [{"soc_model": target.soc_model, "dsp_arch": target.dsp_arch,
                         "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": weight_sharing}}


def absolute(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The config with its file paths resolved against `folder` (the bundle), for a desktop run.

    Every file the config names must be inside the bundle folder (also through links): Genie opens
    whatever a config names, so a `../../etc/passwd` ctx-bin, a tokenizer elsewhere, or a path under a
    key this runner does not resolve (`fcb`, LoRA, …) is refused before Genie sees the config."""
    from ..errors import UserError

    folder = Path(folder).resolve()
    inside(config, folder)
    c = copy.deepcopy(config)
    try:
        d = c["dialog"]
        d["tokenizer"]["path"] = _file(folder, d["tokenizer"]["path"])
        if "lut-path" in d.get("embedding", {}):  # Genie opens it from its working folder, not the config's
            d["embedding"]["lut-path"] = _file(folder, d["embedding"]["lut-path"])
        # one engine, or a speculative dialog's pair (a draft and a target, each with its own binaries)
        for engine in d["engine"] if isinstance(d["engine"], list) else [d["engine"]]:
            binary = engine["model"]["binary"]
            binary["ctx-bins"] = [_file(folder, b) for b in binary["ctx-bins"]]
            for adapter in binary.get("lora", {}).get("adapters", []):
                if "path" in adapter:
                    adapter["path"] = _file(folder, adapter["path"])
            backend = engine["backend"]
            if "extensions" in backend:
                backend["extensions"] = _file(folder, backend["extensions"])
    except (KeyError, TypeError) as e:
        raise UserError(f"The {layout.GENIE_CONFIG} in {folder} is not a Genie dialog over context binaries "
                        f"({type(e).__name__}: {e}).", "Rebuild the bundle with `npustudio bundle`.") from e
    return c


def _file(folder: Path, name: Any) -> str:
    if not isinstance(name, str) or "\0" in name:
        raise TypeError(f"{name!r} is not a file name")
    return str((folder / name).resolve())


def inside(config: Any, folder: Path) -> None:
    """UserError for the first string in the config that names a file outside `folder` (`config_paths`)."""
    from ..config_paths import first_outside
    from ..errors import UserError

    found = first_outside(config, folder)
    if found is not None:
        where, value = found
        raise UserError(f"{layout.GENIE_CONFIG} names {value!r} ({where}), which is outside the bundle folder "
                        f"{Path(folder).resolve()}.",
                        "A bundle's config names only files inside its folder: rebuild the bundle with "
                        "`npustudio bundle`.")


def read(path: Path) -> dict[str, Any]:
    from ..errors import UserError
    from ..fsutil import read_json

    data = read_json(Path(path), "Genie config", "Pass the genie_config.json of a bundle (`npustudio bundle` "
                     "writes one).")
    if not isinstance(data, dict) or "dialog" not in data:
        raise UserError(f"{path} has no 'dialog' section.", "Pass a Genie dialog config (genie_config.json).")
    return data


PROMPT_LIMIT = 2**20  # bytes: ~250,000 tokens of text, more than the longest context NPU Studio compiles holds


def read_prompt_file(path: Path) -> str:
    """A prompt file's text, read at most `PROMPT_LIMIT` bytes deep: the file may be a device (/dev/zero) or a pipe
    that never ends, and read whole it would grow until the system's out-of-memory killer ends the run. A prompt
    that fits is checked against the model's context (in tokens) by the runner."""
    from ..errors import UserError
    from ..fsutil import TooLarge, read_at_most

    try:
        data = read_at_most(Path(path), PROMPT_LIMIT)
    except TooLarge as e:
        what = "is larger than 1 MiB" if Path(path).is_file() else \
            "gave more than 1 MiB and is not a plain file (a device, an endless stream?)"
        raise UserError(f"The prompt file {path} {what}: no model's context holds that much text, so it was not read "
                        "further.", "Pass a text file with the prompt (at most 1 MiB; the model's context in tokens "
                        "is the real limit).") from e
    except IsADirectoryError as e:
        raise UserError(f"The prompt file {path} is a folder.", "Pass a text file with the prompt.") from e
    except OSError as e:
        raise UserError(f"Cannot read the prompt file {path}: {e.strerror or e}.", "Check the path.") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"The prompt file {path} is not UTF-8 text (byte {e.start}).", "Save it as UTF-8 text.") from e


def check_prompt(text: str) -> str:
    """A prompt Genie gets whole: libGenie takes a C string, so a NUL would silently cut it there, and text
    that is not UTF-8 (a binary file, a mis-decoded argument) cannot be encoded for it at all."""
    from ..errors import UserError

    if "\x00" in text:
        raise UserError(f"The prompt contains a NUL character at position {text.index(chr(0))}; Genie would "
                        "silently drop everything after it.", "Remove the NUL bytes (is it a binary file?).")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"The prompt is not valid UTF-8 text (at position {e.start}).",
                        "Pass the prompt as UTF-8 text.") from None
    return text


def sample_prompt(tokenizer: Any, question: str) -> str:
    """The question as the model is asked it: in its chat template, or as plain text for a base model, which
    has no template (Llama-3.2-1B's base release, for one) and continues text instead of answering turns."""
    if not getattr(tokenizer, "chat_template", None):
        return question
    return chat_prompt(tokenizer, question)


def chat_prompt(tokenizer: Any, user: str, system: str | None = None, history: list[dict[str, str]] | None = None,
                bos_added_by_runtime: bool = True) -> str:
    """The model's chat template applied (real newlines), without the BOS Genie prepends itself.

    transformers renders the template in jinja's sandbox; what the sandbox blocks (a template reaching for
    Python internals) or a broken template is a UserError, not a traceback."""
    from jinja2.exceptions import TemplateError

    from ..errors import UserError

    msgs = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    msgs.append({"role": "user", "content": user})
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise UserError(f"The model's chat template cannot be used: {e.__class__.__name__}: {str(e)[:200]}"
                        + (" (the template reaches beyond what a chat template may do; it was stopped by the "
                           "sandbox)" if e.__class__.__name__ == "SecurityError" else ""),
                        "Use a model whose chat template is plain (or fix chat_template in tokenizer_config.json "
                        "/ chat_template.jinja), or send prompts as they are (`genie-run --raw`).") from e
    bos = getattr(tokenizer, "bos_token", None)
    if bos_added_by_runtime and bos and text.startswith(bos):
        text = text[len(bos):]
    return text


def as_chat_prompt(bundle_dir: Path, text: str) -> str:
    """`text` as one user turn in the bundle's chat template (what genie-t2t-run here does without --raw): an
    instruct model asked a bare question often answers with end-of-turn at once. Left as it is when it already
    holds one of the tokenizer's special tokens (a prompt written in the template, as Qualcomm's genie-t2t-run
    takes it) or the model has no template (a base model, or a bundle made without NPU Studio's metadata.json)."""
    from ..errors import UserError
    from .meta import read_metadata

    try:
        meta = read_metadata(Path(bundle_dir))
    except UserError:
        return text
    if not meta.chat_template:
        return text
    tok = template_tokenizer(Path(bundle_dir), meta.bos_id, meta.eos_ids, meta.chat_template)
    if any(t.special and t.content in text for t in tok.added_tokens_decoder.values()):
        return text
    return chat_prompt(tok, text)


def template_tokenizer(bundle_dir: Path, bos_id: int | None, eos_ids: list[int], chat_template: str | None) -> Any:
    """The folder's tokenizer (a bundle's, the MNN stage's) with the model's chat template, bos and eos, for
    rendering prompts."""
    from transformers import PreTrainedTokenizerFast

    from ..errors import UserError

    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle_dir / layout.TOKENIZER))
    if bos_id is not None:
        tok.bos_token = tok.convert_ids_to_tokens(bos_id)
    if eos_ids:
        tok.eos_token = tok.convert_ids_to_tokens(eos_ids[0])
    if not chat_template:
        raise UserError("This model has no chat template.", "Use an instruct/chat model, or genie-run with a prompt.")
    tok.chat_template = chat_template
    return tok
