"""The embedded back-end: onnxruntime + the onnxruntime-qnn plugin EP with its HTP simulator.

Only the plugin-EP API (`register_execution_provider_library` + `add_provider_for_devices`) puts nodes
on QNN; the old `providers=[...]` form silently runs on the CPU. So every session records the graph
assignment, and compiling fails with the list of nodes left on the CPU and QNN's reason for each.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..native_io import fd_redirected
from ..results import Compiled, CpuNode
from ..targets import Soc

QNN_EP = "QNNExecutionProvider"
# QNN's graph finalization per purpose: "phone" its longest (mode 3: the fastest graphs on the NPU); "quick" its
# default (mode 0), for a check on the simulator: the default model's AR-128 graph compiles in 29 s instead of 65,
# gives the same logits and runs as fast on the simulator (mode 1 compiles in 17 s but runs 10 s slower there)
FINALIZATION = {"phone": "3", "quick": "0"}
_registered = False


class GraphTooLarge(Exception):
    """QNN refused a graph whose estimated allocation is over the HTP's per-graph limit (error 1002)."""

    def __init__(self, graph: str, reason: str) -> None:
        super().__init__(reason)
        self.graph, self.reason = graph, reason


_ALLOC = re.compile(r"estimated allocation of (\d+) ?KB")
_TOO_LARGE = re.compile(r"memory usage too large|estimated allocation of \d+ ?KB, limit is", re.IGNORECASE)


def qnn_paths() -> dict[str, str]:
    """The wheel's QNN libraries (libQnnHtp.so = the x86 HTP simulator, libGenie.so) and its SDK version."""
    try:
        import onnxruntime_qnn as oq
    except ImportError as e:
        raise UserError("The onnxruntime-qnn package is not installed.",
                        "Run `bash packaging/bootstrap.sh` to set up the environment.") from e
    folder = os.path.dirname(oq.__file__)
    return {"folder": folder, "ep": oq.get_library_path(), "htp": oq.get_qnn_htp_path(),
            "genie": os.path.join(folder, "libGenie.so"), "version": getattr(oq, "__version__", "")}


def _qnn_devices() -> list[Any]:
    global _registered
    import onnxruntime as ort

    if not _registered:
        with contextlib.suppress(Exception):  # already registered by an earlier call in this process
            ort.register_execution_provider_library(QNN_EP, qnn_paths()["ep"])
        _registered = True
    devs = [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]
    if not devs:
        raise UserError("onnxruntime found no QNN device.", "Reinstall onnxruntime-qnn (bootstrap.sh).")
    return devs


def session_options(target: Soc, context_onnx: Path | None = None, log_level: int = 3, optimize: str = "phone"
                    ) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = log_level
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if context_onnx is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_onnx))
        so.add_session_config_entry("ep.context_embed_mode", "0")
    so.add_provider_for_devices(_qnn_devices(), {
        "backend_path": qnn_paths()["htp"], "htp_arch": str(target.arch_number), "soc_model": str(target.soc_model),
        "htp_graph_finalization_optimization_mode": FINALIZATION[optimize]})
    return so


def assignment(sess: Any) -> tuple[int, list[CpuNode]]:
    on_qnn, cpu = 0, []
    for sg in sess.get_provider_graph_assignment_info():
        nodes = sg.get_nodes()
        if sg.ep_name == QNN_EP:
            on_qnn += len(nodes)
        else:
            cpu += [CpuNode(op_type=n.op_type, name=n.name) for n in nodes]
    return on_qnn, cpu


def compile_graph(qio_onnx: Path, graph: str, out_dir: Path, target: Soc, share: str = "",
                  hold: list[Any] | None = None, optimize: str = "phone") -> Compiled:
    """Compile one prepared graph to `graph`.onnx (EPContext node) + its context binary in `out_dir`.

    share="on" puts the graph into the context being shared (one binary, weights stored once),
    share="last" closes that binary; the sessions of a shared context are kept in `hold` until then.
    """
    import onnxruntime as ort

    ctx = out_dir / f"{graph}.onnx"
    so = session_options(target, ctx, optimize=optimize)
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
        if share == "last":
            so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        try:
            with fd_redirected(1), fd_redirected(2, log.fileno()):  # QNN logs from C++ on fd 2
                sess = ort.InferenceSession(str(qio_onnx), so)
        except Exception as e:  # QNN's own message is the useful part
            text = _read(log)
            if _TOO_LARGE.search(text) or _TOO_LARGE.search(str(e)):
                m = _ALLOC.search(text)
                raise GraphTooLarge(graph, f"QNN estimates {m.group(1)} KB for it, over the HTP's limit" if m
                                    else "QNN says its memory usage is too large for the HTP") from e
            tail = " | ".join(line for line in text.strip().splitlines()[-3:])
            raise UserError(f"QNN could not compile {graph}: {_first_line(e)}" + (f" ({tail})" if tail else ""),
                            "Check that the graph came from this version's quantize stage.") from e
        found = _ALLOC.search(_read(log))
    seconds = time.perf_counter() - t0
    on_qnn, cpu = assignment(sess)
    if hold is not None:
        hold.append(sess)
    del sess
    if cpu:
        cpu = explain_cpu_nodes(qio_onnx, target, cpu)
    binary = out_dir / context_node(ctx)[1] if ctx.is_file() else None
    if binary is None or not (binary.is_file() or share == "on"):  # a shared binary is written by its last graph
        raise UserError(f"onnxruntime-qnn wrote no context binary for {graph}.", "Re-run the compile stage.")
    return Compiled(graph=graph, context_onnx=ctx.name, context_bin=binary.name,
                    bin_bytes=binary.stat().st_size if binary.is_file() else 0, seconds=round(seconds, 2),
                    nodes_on_qnn=on_qnn, nodes_on_cpu=cpu, qnn_alloc_kb=int(found.group(1)) if found else None)


def _read(log: Any) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def context_node(ctx_onnx: Path) -> tuple[str, str]:
    """(QNN graph name, context binary file) of a compiled graph's EPContext node."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        nodes = [n for n in onnx.load(str(ctx_onnx)).graph.node if n.op_type == "EPContext"]
    except (OSError, DecodeError) as e:
        raise UserError(f"{ctx_onnx.name} is not a readable ONNX file ({e}).", "Re-run the compile stage.") from e
    attrs = {a.name: a.s.decode() for a in nodes[0].attribute if a.s} if len(nodes) == 1 else {}
    if "ep_cache_context" not in attrs:
        raise UserError(f"{ctx_onnx.name} is not a compiled context (one EPContext node naming its binary).",
                        "Re-run the compile stage.")
    return nodes[0].name, attrs["ep_cache_context"]


def explain_cpu_nodes(model: Path, target: Soc, cpu: list[CpuNode]) -> list[CpuNode]:
    """QNN's reason for each node it refused, read from the EP's verbose log of a second session."""
    import onnxruntime as ort

    with tempfile.TemporaryFile() as log:
        with fd_redirected(2, log.fileno()), contextlib.suppress(Exception):  # ORT logs from C++ on fd 2
            ort.InferenceSession(str(model), session_options(target, log_level=0))
        log.seek(0)
        text = log.read().decode(errors="replace")
    reasons: dict[str, str] = {}
    for m in re.finditer(r"Node name: (\S+) Node index: \d+\s+REASON : ([^\n]+)", text):
        reasons.setdefault(m.group(1), m.group(2).strip())
    return [n.model_copy(update={"reason": reasons.get(n.name, "")}) for n in cpu]


def context_session(ctx_onnx: Path, target: Soc) -> Any:
    """A session over a compiled context (runs on the HTP simulator here, on the NPU on a Snapdragon PC)."""
    import onnxruntime as ort

    with fd_redirected(1):
        sess = ort.InferenceSession(str(ctx_onnx), session_options(target))
    _, cpu = assignment(sess)
    if cpu:
        raise UserError(f"{ctx_onnx.name} did not load onto QNN ({len(cpu)} nodes on the CPU).",
                        "Re-run the compile stage.")
    return sess


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[-1] if s else type(e).__name__
