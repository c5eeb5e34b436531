"""Argument types and the stage options: each option's default, bounds, choices and help come from its pydantic
Field (core/stage_options.py), so they change in one place and the CLI follows. That module is light: building
the parser imports no torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_args

from pydantic import BaseModel

from ..core import stage_options as so
from ..core.errors import UserError
from ..core.stage_options import (
    MAX_CONTEXT,
    AdaptOptions,
    BundleOptions,
    CompileOptions,
    MnnOptions,
    QuantizeOptions,
    Sampler,
)

if TYPE_CHECKING:
    from ..core.cluster import Cluster

__all__ = ["MAX_CONTEXT", "given", "int_in", "number_in", "option"]


def number_in(lo: float, hi: float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in [lo, hi] (`above`: in (lo, hi]), else a plain message (exit 2)."""
    use = f"more than {lo:g}, up to {hi:g}" if above else f"{lo:g} to {hi:g}"

    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (use {use})") from None
        if not (lo < v if above else lo <= v) or not v <= hi:
            raise argparse.ArgumentTypeError(f"{v:g} is out of range (use {use})")
        return v

    parse.__name__ = "number"
    return parse


def int_in(lo: int, hi: int, skip: range | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [lo, hi] (not in `skip`), else a plain message (exit 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (use {lo} to {hi})") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range (use {lo} to {hi})")
        if skip is not None and v in skip:
            raise argparse.ArgumentTypeError(f"{v} is reserved for Android emulators ({skip.start}-{skip.stop - 1}); "
                                             "pick another port, or 0 for any free one")
        return v

    parse.__name__ = "number"  # argparse names the type in its messages
    return parse


def given(text: str) -> str:
    """An argparse type for paths and names: an empty one ('') is a mistake, not the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (give a path or a name)")
    return text


def field_type(model: type[BaseModel], name: str) -> Callable[[str], Any] | None:
    """The argparse type a number field's bounds make: `int_in`/`number_in` over its range (None: no range)."""
    b = so.bounds(model, name)
    if b.lo is None or b.hi is None:
        return None
    ann = model.model_fields[name].annotation
    if int in (get_args(ann) or (ann,)):  # int, or int | None
        return int_in(*so.int_range(model, name))
    return number_in(b.lo, b.hi, above=b.lo_open)


def option(s: argparse._ActionsContainer, model: type[BaseModel], name: str, *flags: str, dest: str | None = None,
           **kw: Any) -> None:
    """`--name` for the field `name` of a stage's options: its default, bounds (type=), choices and (unless given)
    its help are the field's, a flag for a bool; `kw` overrides them. `dest`: where argparse keeps it (default:
    the field's name)."""
    field = model.model_fields[name]
    kw.setdefault("help", field.description)
    if field.annotation is bool:
        kw.setdefault("action", "store_false" if field.default else "store_true")
    else:
        kw.setdefault("default", so.default(model, name))
        if "type" not in kw and (t := field_type(model, name)) is not None:
            kw["type"] = t
        if "choices" not in kw and (c := so.choices(model, name)) is not None:
            kw["choices"] = list(c)
    s.add_argument(*(flags or (f"--{name.replace('_', '-')}",)), dest=dest or name, **kw)


def lora_arg(s: argparse.ArgumentParser) -> None:
    from ..core.lora import parse

    def adapter(text: str) -> so.LoraAdapter:
        return parse(given(text))

    s.add_argument("--lora", action="append", type=adapter, default=[], metavar="DIR[=WEIGHT]",
                   help="a LoRA adapter (the folder PEFT saved: adapter_config.json, adapter_model.safetensors) "
                        "merged into the model before adaptation, its update times WEIGHT (default 1); repeatable")


def adapt_args(s: argparse.ArgumentParser) -> None:
    O = AdaptOptions
    lora_arg(s)
    s.add_argument("--lora-switchable", action="store_true",
                   help="keep the --lora adapters apart: one bundle answers as the base model or with any of them, "
                        "chosen in the chat (npustudio chat --lora NAME) instead of merged")

    option(s, O, "ar")
    option(s, O, "cl")
    option(s, O, "eval_corpus", type=given, help="default | text file | datasets:ID")
    option(s, O, "eval_tokens")
    option(s, O, "decode_tokens")
    option(s, O, "accept_mismatch", help="keep adapted graphs that fail the equivalence gate (recorded in the "
           "project; they will not answer like the original model)")


def quantize_args(s: argparse.ArgumentParser) -> None:
    from ..core.targets import KNOWN_SOCS

    O = QuantizeOptions
    option(s, O, "precision")
    option(s, O, "target", help=f"target SoC ({', '.join(KNOWN_SOCS)})")
    option(s, O, "recipe")
    option(s, O, "adascale_iterations")
    option(s, O, "omniquant_iterations")
    option(s, O, "seed")
    option(s, O, "int8_budget", metavar="SHARE")
    option(s, O, "lm_head_bits", type=int)
    option(s, O, "calib_corpus", type=given, help="default | text file | datasets:ID")
    option(s, O, "calib_samples")
    option(s, O, "calib_len")
    s.add_argument("--overrides", type=given, default=None, help="JSON file of per-module bitwidths (mixed "
                   "precision)")
    option(s, O, "eval_chars", help="evaluate on the first N characters only")


def compile_args(s: argparse.ArgumentParser, job: bool = False) -> None:
    """The compile stage's options; `job`: for `run`, which picks what the graphs are for unless told."""
    O = CompileOptions

    option(s, O, "backend", help="ort-qnn: embedded onnxruntime-qnn (HTP simulator); qairt: the SDK at QNN_SDK_ROOT")
    option(s, O, "verify_tokens")
    option(s, O, "prompt_check_budget_s", "--prompt-check-budget",
           help="seconds: run the prompt graph on the HTP simulator when its estimated time there is under this "
                "(over it, the token graph's steps alone are checked and the record says so)")
    option(s, O, "parts",
           help="split the model into N contexts `…_i_of_N` (0: as many as keep each under --max-part-mb)")
    max_part_arg(s)
    if job:
        option(s, O, "optimize", default=None,
               help="what QNN finalizes the graphs for (default: phone when the job deploys to a phone attached "
                    "now, else quick: for the simulator)")
    else:
        option(s, O, "optimize")
    if job:  # unset: the job's plan decides (shared weights for a phone when the unshared contexts would not fit)
        option(s, O, "weight_sharing", action=argparse.BooleanOptionalAction, default=None,
               help=f"{O.model_fields['weight_sharing'].description} (default: as the plan decides)")
    else:
        option(s, O, "weight_sharing")
    option(s, O, "embedding_lut", action=argparse.BooleanOptionalAction, default=None if job else True,
           **({"help": f"{O.model_fields['embedding_lut'].description} (default: on, off with --draft)"}
              if job else {}))
    if not job:
        mnn_args(s)


def mnn_args(s: argparse.ArgumentParser) -> None:
    """The MNN back-end's options (`compile --backend mnn`), refused with another back-end (`compile_options`)."""
    O = MnnOptions
    g = s.add_argument_group("--backend mnn")
    for name, flag in MNN_FLAGS.items():
        numbers = all(isinstance(c, int) for c in so.choices(O, name) or ["text"])
        option(g, O, name, flag, dest=f"mnn_{name}", **({"type": int} if numbers else {}))
    g.add_argument("--mnn-sample", action="store_true",
                   help="the phone's llm_demo samples (top-k/top-p) instead of answering greedily")


def max_part_arg(s: argparse.ArgumentParser) -> None:
    option(s, CompileOptions, "max_part_mb",
           help="largest estimated HTP allocation of one part's graph, MiB (the HTP refuses graphs over 2 GiB: the "
                "default keeps a 10%% margin)")


def device_arg(s: argparse.ArgumentParser) -> None:
    option(s, AdaptOptions, "device",
           help="where the torch work runs (auto: the CUDA GPU when torch sees one)")


def cluster_address(text: str) -> str:
    """An argparse type: a Ray cluster address (HOST:PORT or ray://HOST:PORT)."""
    from ..core.cluster import host_port

    try:
        host_port(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(f"{e.problem} {e.fix}") from None
    return text.strip()


def cluster_arg(s: argparse.ArgumentParser, stages: str) -> None:
    s.add_argument("--cluster", type=cluster_address, default=None, metavar="ADDRESS",
                   help=f"run {stages} on the Ray cluster at ADDRESS (HOST:PORT as `ray start --head` prints it, or "
                        "ray://HOST:10001); its files come back into the project")
    s.add_argument("--cluster-install", action="store_true",
                   help="with --cluster: Ray installs this computer's versions of NPU Studio's requirements on the "
                        "workers first (runtime_env; the workers need their package index)")


def cluster_of(a: argparse.Namespace) -> Cluster | None:
    """The --cluster target; its address is checked to answer as a Ray head first, so that a wrong address is
    said within seconds, before any local work."""
    from ..core.cluster import Cluster, check_reachable

    if a.cluster_install and not a.cluster:
        raise UserError("--cluster-install needs --cluster ADDRESS.", "Add the cluster's address, or leave it out.")
    if not a.cluster:
        return None
    check_reachable(a.cluster)
    return Cluster(a.cluster, install=a.cluster_install)


def adapt_options(a: argparse.Namespace) -> AdaptOptions:
    return AdaptOptions(ar=a.ar, cl=a.cl, eval_corpus=a.eval_corpus, eval_tokens=a.eval_tokens,
                        decode_tokens=a.decode_tokens, device=a.device, accept_mismatch=a.accept_mismatch,
                        lora=tuple(a.lora), lora_switchable=a.lora_switchable)


def quantize_options(a: argparse.Namespace) -> QuantizeOptions:
    from ..core.quantize.presets import load_overrides

    chosen = {"precision": a.precision} if a.precision else {}  # `run` plans it when neither flag nor settings do
    return QuantizeOptions(target=a.target, recipe=a.recipe, adascale_iterations=a.adascale_iterations,
                           omniquant_iterations=a.omniquant_iterations, seed=a.seed,
                           int8_budget=a.int8_budget, lm_head_bits=a.lm_head_bits,
                           calib_corpus=a.calib_corpus, calib_samples=a.calib_samples, calib_len=a.calib_len,
                           overrides=load_overrides(a.overrides), eval_chars=a.eval_chars, device=a.device,
                           eval_corpus=getattr(a, "eval_corpus", None), **chosen)


# the MNN back-end's flags (kept by argparse as mnn_NAME: `eval_tokens` is also adapt's)
MNN_FLAGS = {"bits": "--mnn-bits", "block": "--mnn-block", "lm_head_bits": "--mnn-lm-head-bits",
             "method": "--mnn-method", "eval_tokens": "--mnn-eval-tokens", "max_ppl_ratio": "--max-ppl-ratio"}
QNN_FLAGS = {"verify_tokens": "--verify-tokens", "prompt_check_budget_s": "--prompt-check-budget", "parts": "--parts",
             "max_part_mb": "--max-part-mb", "optimize": "--optimize", "weight_sharing": "--weight-sharing",
             "embedding_lut": "--no-embedding-lut"}


def _given(a: argparse.Namespace, flags: dict[str, str], model: type[BaseModel], prefix: str = "") -> list[str]:
    """The flags of `flags` set to other than their field's default (argparse keeps each as `prefix + name`)."""
    return [flag for name, flag in flags.items()
            if (v := getattr(a, prefix + name, None)) is not None and v != so.default(model, name)]


def mnn_options(a: argparse.Namespace) -> MnnOptions:
    """`compile --backend mnn`'s options; the QNN back-ends' flags are refused."""
    if given := _given(a, QNN_FLAGS, CompileOptions):
        raise UserError(f"{', '.join(given)} do not apply to the MNN back-end (they shape QNN context binaries).",
                        "Leave them out with `--backend mnn`.")
    return MnnOptions(sampler=Sampler(greedy=not a.mnn_sample),
                      **{name: getattr(a, f"mnn_{name}") for name in MNN_FLAGS})


def compile_options(a: argparse.Namespace) -> CompileOptions:
    """The QNN back-ends' options; the MNN back-end's flags are refused."""
    if a.backend == "mnn":
        raise UserError("`--backend mnn` is its own stage, made from the float model.",
                        "Run `npustudio compile --backend mnn --project P`.")
    if getattr(a, "model", None) is not None and getattr(a, "cmd", "") == "compile":
        raise UserError("--model applies to `--backend mnn` only: the QNN back-ends compile the project's "
                        "quantized graphs.", "Leave --model out, or add `--backend mnn`.")
    sample = ["--mnn-sample"] if getattr(a, "mnn_sample", False) else []
    if given := _given(a, MNN_FLAGS, MnnOptions, "mnn_") + sample:
        raise UserError(f"{', '.join(given)} apply to `--backend mnn` only.",
                        f"Add `--backend mnn`, or leave them out with `--backend {a.backend}`.")
    chosen = {"optimize": a.optimize} if a.optimize else {}  # `run` decides when it is not given
    if a.weight_sharing is not None:  # `run` plans it when not given
        chosen["weight_sharing"] = a.weight_sharing
    if a.embedding_lut is not None:  # `run` plans it when not given (off for draft-model decoding)
        chosen["embedding_lut"] = a.embedding_lut
    return CompileOptions(backend=a.backend, verify_tokens=a.verify_tokens, parts=a.parts,
                          prompt_check_budget_s=a.prompt_check_budget_s, max_part_mb=a.max_part_mb, **chosen)


def bundle_options(a: argparse.Namespace) -> BundleOptions:
    from ..core.genie.config import check_prompt

    return BundleOptions(question=check_prompt(a.question), sampler=Sampler(greedy=not a.sample),
                         prompt_graphs=not a.token_graphs_only, **decoding_options(a))


def decoding_args(s: argparse.ArgumentParser) -> None:
    """How the phone decodes the bundle: `bundle` and `run` take the same flags."""
    option(s, BundleOptions, "decoding")
    option(s, BundleOptions, "draft", type=given, metavar="DRAFT_PROJECT")
    option(s, BundleOptions, "draft_len", metavar="K")


def decoding_options(a: argparse.Namespace) -> dict[str, Any]:
    given_ = {k: getattr(a, k) for k in ("decoding", "draft") if getattr(a, k, None) is not None}
    return given_ | {"draft_len": getattr(a, "draft_len", so.default(BundleOptions, "draft_len"))}
