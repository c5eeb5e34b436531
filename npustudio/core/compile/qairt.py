"""The SDK back-end: QAIRT's own tools, when `QNN_SDK_ROOT` points at a QAIRT SDK.

qairt-converter (the AIMET encodings as `--quantization_overrides`) -> qairt-quantizer -> one
qnn-context-binary-generator run over the prompt and token DLCs with weight sharing (one binary, the
phone layout) -> qnn-context-binary-utility, whose JSON is checked for graph names, AR/CL and arch.
Each tool runs as an argument list (no shell); a failing tool's own message is shown.

The SDK is not on the build machine this project is tested on: the command lines, configs and result
parsing are tested against stand-in executables there, never presented as a real SDK run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import layout
from ..errors import UserError
from ..fsutil import atomic_write_json
from ..progress import StateLike, peak_rss_mb
from ..results import Verification
from ..stages import QUANTIZE, load_graphs
from ..targets import Soc, find_soc

if TYPE_CHECKING:
    from . import CompileOptions, CompileResult

BAD_VERSIONS = ("2.38.",)  # known Genie breakage
HOST = "x86_64-linux-clang"


def sdk_root() -> Path:
    root = os.environ.get("QNN_SDK_ROOT")
    if not root:
        raise UserError("The qairt back-end needs the QAIRT SDK, and QNN_SDK_ROOT is not set.",
                        "Install the QAIRT SDK and `export QNN_SDK_ROOT=/path/to/qairt/<version>`, or use "
                        "`--backend ort-qnn` (embedded).")
    p = Path(root)
    if not (p / "bin" / HOST).is_dir():
        raise UserError(f"QNN_SDK_ROOT={root} does not look like a QAIRT SDK (no bin/{HOST}).",
                        "Point QNN_SDK_ROOT at the SDK's version folder (the one holding bin/ and lib/).")
    return p


def sdk_version(root: Path) -> str:
    """From sdk.yaml (`version: 2.31.0.250130`), else the folder name."""
    y = root / "sdk.yaml"
    if y.is_file():
        m = re.search(r"^\s*version:\s*([0-9][\w.]*)", y.read_text(errors="replace"), re.MULTILINE)
        if m:
            return m.group(1)
    m = re.match(r"(\d+\.\d+\.\d+[\w.]*)", root.name)
    if m:
        return m.group(1)
    raise UserError(f"Cannot tell the version of the SDK at {root}.", "Use an SDK folder with its sdk.yaml.")


def check_version(version: str, phone_runtime: str | None = None) -> list[str]:
    """Refuse a known-bad SDK; warn when the phone's runtime is older than the compiler (error 5000)."""
    if version.startswith(BAD_VERSIONS):
        raise UserError(f"QAIRT {version} has a known Genie issue.", "Use another QAIRT version (e.g. 2.37 or 2.39+).")
    warnings = []
    if phone_runtime and _vtuple(phone_runtime) < _vtuple(version):
        warnings.append(f"The phone's QNN runtime ({phone_runtime}) is older than this SDK ({version}): Genie on "
                        "the phone will fail with error 5000 unless the bundle carries this SDK's runtime.")
    return warnings


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def tool(root: Path, name: str) -> str:
    p = root / "bin" / HOST / name
    if not p.is_file():
        raise UserError(f"{name} is missing from the SDK at {root}.", "Reinstall the QAIRT SDK.")
    return str(p)


def commands(root: Path, quant_dir: Path, graphs: list[str], target: Soc, out: Path) -> list[list[str]]:
    """The exact tool invocations, in order (also what `--dry-run`-style tests check)."""
    cmds: list[list[str]] = []
    dlcs = []
    for g in graphs:
        dlc, qdlc = out / f"{g}.dlc", out / f"{g}_q.dlc"
        cmds.append([tool(root, "qairt-converter"), "--input_network", str(quant_dir / f"{g}.onnx"),
                     "--output_path", str(dlc), "--quantization_overrides", str(quant_dir / f"{g}.encodings"),
                     "--preserve_io_datatype", "--float_bitwidth", "16"])
        cmds.append([tool(root, "qairt-quantizer"), "--input_dlc", str(dlc), "--output_dlc", str(qdlc),
                     "--act_bitwidth", "16", "--bias_bitwidth", "32", "--enable_float_fallback"])
        dlcs.append(str(qdlc))
    cmds.append([tool(root, "qnn-context-binary-generator"),
                 "--model", str(root / "lib" / HOST / "libQnnModelDlc.so"),
                 "--backend", str(root / "lib" / HOST / "libQnnHtp.so"),
                 "--dlc_path", ",".join(dlcs), "--config_file", str(out / "htp_config.json"),
                 "--binary_file", binary_name(graphs), "--output_dir", str(out)])
    cmds.append([tool(root, "qnn-context-binary-utility"), "--context_binary",
                 str(out / f"{binary_name(graphs)}.bin"), "--json_file", str(out / f"{binary_name(graphs)}.json")])
    return cmds


def binary_name(graphs: list[str]) -> str:
    """`model_1_of_1` from `prompt_ar128_cl1024_1_of_1`: one weight-shared binary per part."""
    m = re.search(r"_(\d+)_of_(\d+)$", graphs[0])
    return f"model_{m.group(1)}_of_{m.group(2)}" if m else "model_1_of_1"


def write_configs(root: Path, graphs: list[str], target: Soc, out: Path) -> None:
    atomic_write_json(out / "htp_backend_config.json", {
        "graphs": [{"graph_names": graphs, "O": 3, "vtcm_mb": 8}],
        "devices": [{"dsp_arch": target.dsp_arch, "soc_model": target.soc_model}],
        "context": {"weight_sharing_enabled": True}})
    atomic_write_json(out / "htp_config.json", {"backend_extensions": {
        "shared_library_path": str(root / "lib" / HOST / "libQnnHtpNetRunExtensions.so"),
        "config_file_path": str(out / "htp_backend_config.json")}})


def parse_utility(path: Path, graphs: list[str], ar_cl: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Check the binary's graphs: names, AR (input_ids length) and CL (mask width)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"qnn-context-binary-utility wrote no readable JSON ({e}).", "See the tool's output.") from e
    found: dict[str, dict[str, list[int]]] = {}
    for g in _walk(data):
        name = g.get("graphName")
        if isinstance(name, str):
            tensors = {}
            for key in ("graphInputs", "graphOutputs"):
                for t in g.get(key, []):
                    info = t.get("info", t) if isinstance(t, dict) else {}
                    if isinstance(info, dict) and "name" in info:
                        tensors[info["name"]] = list(info.get("dimensions", []))
            found[name] = tensors
    missing = [g for g in graphs if g not in found]
    if missing:
        raise UserError(f"The context binary lacks the graphs {missing} (it has {sorted(found)}).",
                        "Re-run the compile stage; the graph names must match the DLCs.")
    for g, (ar, cl) in ar_cl.items():
        t = found[g]
        if t.get("input_ids", [None, ar])[-1] != ar or t.get("attention_mask", [cl])[-1] != cl:
            raise UserError(f"Graph {g} has input_ids {t.get('input_ids')} / attention_mask "
                            f"{t.get('attention_mask')}, expected AR {ar} and CL {cl}.", "Re-run the compile stage.")
    arch = _find(data, ("dspArch", "htpArch", "arch"))
    return {"graphs": sorted(found), "arch": arch}


def _walk(x: Any) -> Any:
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)


def _find(x: Any, keys: tuple[str, ...]) -> Any:
    for d in _walk(x):
        for k in keys:
            if k in d and not isinstance(d[k], dict | list):
                return d[k]
    return None


def run(quant_dir: Path, options: CompileOptions, out_dir: Path, state: StateLike) -> CompileResult:
    from ..graph.graph_io import activation_encodings
    from ..results import Compiled
    from . import CompileResult

    root = sdk_root()
    version = sdk_version(root)
    warnings = check_version(version)
    qres = QUANTIZE.load(quant_dir)
    target = find_soc(options.target or qres.target)
    graphs = qres.graphs
    specs = {g.name: (g.ar, g.cl) for g in load_graphs(quant_dir)}
    write_configs(root, graphs, target, out_dir)
    steps: dict[str, float] = {}
    for i, cmd in enumerate(cmds := commands(root, quant_dir, graphs, target, out_dir)):
        state.check()
        name = Path(cmd[0]).name
        state.progress(i / len(cmds), f"{name} ({version})")
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        steps[f"{name}_{i}"] = round(time.perf_counter() - t0, 2)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-8:]
            raise UserError(f"{name} failed (exit {p.returncode}):\n" + "\n".join(tail),
                            "Fix what the tool says; the full command is in compile_commands.json.")
    atomic_write_json(out_dir / layout.COMPILE_COMMANDS, cmds)
    binary = out_dir / f"{binary_name(graphs)}.bin"
    check = parse_utility(out_dir / f"{binary_name(graphs)}.json", graphs, specs)
    io = {name: enc for name, enc in activation_encodings(quant_dir / f"{graphs[0]}.encodings").items()
          if name in ("attention_mask", "position_ids_cos", "position_ids_sin", "logits")
          or name.startswith(("past_", "lora_"))}  # lora_*: switchable adapters' inputs (graph.lora_inputs)
    size = binary.stat().st_size if binary.is_file() else 0
    compiled = [Compiled(graph=g, context_onnx="", context_bin=binary.name, bin_bytes=size, seconds=0.0,
                         nodes_on_qnn=0, nodes_on_cpu=[]) for g in graphs]
    res = CompileResult(backend="qairt", target=target.soc, soc_model=target.soc_model, dsp_arch=target.dsp_arch,
                        graphs=compiled, nodes_on_cpu=0, io=io,
                        verification=Verification(sdk_version=version, warnings=warnings, binary_check=check,
                                                  simulator="not run: a weight-shared binary does not run on the "
                                                            "x86 simulator; verify on the phone"),
                        steps=steps, peak_rss_mb=round(peak_rss_mb()))
    atomic_write_json(out_dir / layout.COMPILE_RESULT, res.model_dump())
    return res
