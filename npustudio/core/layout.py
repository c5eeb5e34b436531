"""Every file and folder name of a project and of a Genie bundle, in one place: the stages, the GUI, the CLI and
the device code read and write these names only through here, so a name changes in one line.

A project folder::

    npustudio.json              the manifest: each stage's record (inputs, options, output files, result)
    .lock                       held (flock) by the one process working on the project
    stages/<stage>/             a stage's output, swapped in whole when the stage ends
    stages/.<stage>.partial/    the same while it runs (a killed stage leaves only this)
    runs/                       profiles of sample answers
    logs/                       tracebacks of unexpected errors (the CLI's)

A Genie bundle (a project's stages/bundle, or any folder `npustudio bundle` wrote) holds GENIE_CONFIG,
HTP_EXT_CONFIG, TOKENIZER, METADATA, SAMPLE_PROMPT, the context binaries, EMBEDDING_LUT when the graphs start from
token embeddings, and, once chatted with, CHAT_HISTORY.
"""

from __future__ import annotations

from pathlib import Path

# ----- a project
MANIFEST = "npustudio.json"
LOCK = ".lock"
STAGES_DIR = "stages"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
SCRATCH_SUFFIX = ".partial"  # stages/.<stage>.partial: a stage's output while it runs
PROJECT_ENTRIES = (MANIFEST, LOCK, STAGES_DIR, RUNS_DIR, LOGS_DIR)  # all a project folder holds of its own
SAMPLE_PROFILE = "sample_profile.json"  # in RUNS_DIR: Genie's profile of the sample answer of `npustudio run`

# ----- the model stage
MODEL_RESULT = "model.json"


# ----- adapt
ADAPT_RESULT = "adapt.json"
CARD = "card.json"  # the architecture card beside the adapted graphs
GRAPHS = "graphs.json"
EQUIVALENCE = "equivalence.json"
DECODER_WEIGHTS = "decoder.safetensors"
DECODER_SPEC = "decoder.json"
REFERENCE_LOGITS = "reference_logits.safetensors"
EVAL_PLAN = "eval_plan.json"
LORA_PLACES = "lora_places.json"  # where each merged LoRA module's rows are in the graph tensors
LORA_SLOTS = "lora_slots.json"  # adapt, switchable adapters: the graph inputs each adapted Linear takes
LORA_INPUTS = "lora_inputs"  # adapt, switchable adapters: what those inputs hold, NAME.safetensors per adapter
LORA_ALPHA = "lora_alpha"  # switchable adapters: the graph input Genie writes an adapter's strength into
LORA_BUNDLE = "lora"  # bundle, switchable adapters: NAME/INPUT.raw (float32), what Genie reads when one is applied

# ----- quantize
QUANTIZE_RESULT = "quantize.json"
EXPORTED_FILES = "files.json"
WEIGHTS = "weights.bin"  # every large initializer of the exported graphs, stored once by content
TEST_VECTORS = "test_vectors"  # folder: {graph}.npz

# ----- compile
COMPILE_RESULT = "compile.json"
PREPARED = "prepared"  # the Genie-ready graphs (uint I/O): the CPU preview and the verification reference
COMPILE_COMMANDS = "compile_commands.json"

# ----- a Genie bundle
GENIE_CONFIG = "genie_config.json"
HTP_EXT_CONFIG = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"
METADATA = "metadata.json"
DRAFT_PREFIX = "draft_"  # a draft-model bundle's draft binaries, beside the target's
BUNDLE_RESULT = "bundle.json"
SAMPLE_PROMPT = "sample_prompt.txt"
EMBEDDING_LUT = "embedding_lut.dat"  # the token-embedding rows Genie looks up on the CPU (also in compile/prepared)
MNN_RESULT = "mnn.json"
MNN_MODEL = "model"  # folder: what MNN's LLM runtime loads (config.json, llm.mnn, llm.mnn.weight, tokenizer …)
MNN_CONFIG = "config.json"  # in MNN_MODEL: the file MNN's runtime is pointed at
CHAT_HISTORY = "chat_history.json"
CHAT_HISTORY_ASIDE = "chat_history.unreadable-*.json"  # an unreadable history, set aside by the chat (a glob)

# ----- on a device, next to the pushed bundle
DEVICE_MANIFEST = ".npustudio-manifest.json"
PROMPT_FILE = "prompt.txt"
PROFILE_FILE = "profile.json"


def stage_dir(root: Path, stage: str) -> Path:
    return Path(root) / STAGES_DIR / stage


def scratch_dir(root: Path, stage: str) -> Path:
    """Where a stage writes while it runs."""
    return Path(root) / STAGES_DIR / f".{stage}{SCRATCH_SUFFIX}"


def old_dir(root: Path, stage: str) -> Path:
    """Where the previous output waits while the new one is swapped in."""
    return Path(root) / STAGES_DIR / f".{stage}.old"


def project_of_stage(folder: Path) -> Path | None:
    """The project folder whose stage `folder` is, or None when `folder` is not a project's stage folder."""
    folder = Path(folder).resolve()
    if folder.parent.name == STAGES_DIR and (folder.parents[1] / MANIFEST).is_file():
        return folder.parents[1]
    return None
