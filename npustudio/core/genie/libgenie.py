"""ctypes over Qualcomm's libGenie.so: config validation, dialogs with streamed tokens, abort, profiles.

On this machine the library is the x86 build shipped in onnxruntime-qnn, running on the HTP simulator;
with `QNN_SDK_ROOT` set, the SDK's own x86 build is used instead. Signatures follow GenieDialog.h /
GenieProfile.h / GenieLog.h (Genie API 1.21, checked against the x86 library by the tests).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..parts import PD_BUDGET_BYTES

H = ctypes.c_void_p
_LOGCB = ctypes.CFUNCTYPE(None, H, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p)
_QUERYCB = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
_ALLOC = ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p))

STATUS = {0: "success", 1: "aborted", 2: "bound handle", 3: "paused", 4: "context limit exceeded",
          -1: "general error", -2: "invalid argument", -3: "memory allocation failed", -4: "invalid config",
          -5: "invalid handle", -6: "query failed", -7: "JSON format error", -8: "JSON schema error",
          -9: "JSON value error", -10: "generate failed", -11: "get handle failed", -12: "apply config failed",
          -13: "set params failed", -14: "bound handle"}
SENTENCE = {0: "COMPLETE", 1: "BEGIN", 2: "CONTINUE", 3: "END", 4: "ABORT", 5: "REWIND", 6: "RESUME"}
LOG_LEVELS = {"error": 1, "warn": 2, "info": 3, "verbose": 4}
ACTION_ABORT = 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library_dir() -> Path:
    """Where libGenie.so and its QNN libraries are: the SDK's x86 libs, else onnxruntime-qnn's."""
    sdk = os.environ.get("QNN_SDK_ROOT")
    if sdk and (Path(sdk) / "lib" / "x86_64-linux-clang" / "libGenie.so").is_file():
        return Path(sdk) / "lib" / "x86_64-linux-clang"
    from ..graph.ort_qnn import qnn_paths

    return Path(qnn_paths()["folder"])


def load() -> ctypes.CDLL:
    """Load libGenie once. Its QNN libraries are loaded first, globally, so it finds them by soname."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        folder = library_dir()
        if not (folder / "libGenie.so").is_file():
            raise UserError(f"libGenie.so is not in {folder}.", "Reinstall onnxruntime-qnn (bootstrap.sh) or "
                            "point QNN_SDK_ROOT at a QAIRT SDK.")
        # onnxruntime first: the QNN libraries come with their own C++ unwinder (libunwind, libc++abi), which global
        # loading puts before the system's; an onnxruntime imported after them (the CPU preview, a compile, in the
        # same process) crashed on the first C++ exception of its own start-up (SIGSEGV in unw_get_proc_info)
        import onnxruntime  # noqa: F401

        from ..native_io import fd_redirected

        with fd_redirected(1):  # their load-time banner would land in the answer on stdout
            for dep in ("libQnnSystem.so", "libQnnHtp.so"):
                if (folder / dep).is_file():
                    ctypes.CDLL(str(folder / dep), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(str(folder / "libGenie.so"), mode=ctypes.RTLD_GLOBAL)
        _declare(lib)
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    i32, p = ctypes.c_int32, ctypes.POINTER
    sigs: dict[str, tuple[list[object], object]] = {
        "GenieLog_create": ([H, _LOGCB, ctypes.c_int, p(H)], i32),
        "GenieLog_free": ([H], i32),
        "GenieDialogConfig_createFromJson": ([ctypes.c_char_p, p(H)], i32),
        "GenieDialogConfig_bindLogger": ([H, H], i32),
        "GenieDialogConfig_bindProfiler": ([H, H], i32),
        "GenieDialogConfig_free": ([H], i32),
        "GenieDialog_create": ([H, p(H)], i32),
        "GenieDialog_query": ([H, ctypes.c_char_p, ctypes.c_int, _QUERYCB, ctypes.c_void_p], i32),
        "GenieDialog_signal": ([H, ctypes.c_int], i32),
        "GenieDialog_setMaxNumTokens": ([H, ctypes.c_uint32], i32),
        "GenieDialog_reset": ([H], i32),
        "GenieDialog_applyLora": ([H, ctypes.c_char_p, ctypes.c_char_p], i32),
        "GenieDialog_setLoraStrength": ([H, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_float], i32),
        "GenieDialog_free": ([H], i32),
        "GenieProfile_create": ([H, p(H)], i32),
        "GenieProfile_getJsonData": ([H, _ALLOC, p(ctypes.c_char_p)], i32),
        "GenieProfile_free": ([H], i32),
        "Genie_getApiMajorVersion": ([], ctypes.c_uint32),
        "Genie_getApiMinorVersion": ([], ctypes.c_uint32),
        "Genie_getApiPatchVersion": ([], ctypes.c_uint32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def api_version() -> str:
    lib = load()
    return f"{lib.Genie_getApiMajorVersion()}.{lib.Genie_getApiMinorVersion()}.{lib.Genie_getApiPatchVersion()}"


def describe(status: int) -> str:
    return f"{status} ({STATUS.get(status, 'unknown status')})"


@dataclass
class Logger:
    """A Genie log handle that keeps every line (and forwards it, if asked)."""

    level: int = 2
    forward: Callable[[int, str], None] | None = None
    lines: list[str] = field(default_factory=list)
    handle: H = field(default_factory=H)

    def __post_init__(self) -> None:
        lib = load()
        libc = ctypes.CDLL(None)
        libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]

        def on_log(_h: object, fmt: bytes, level: int, _ts: int, va: object) -> None:
            buf = ctypes.create_string_buffer(8192)
            libc.vsnprintf(buf, 8192, fmt, va)
            line = buf.value.decode(errors="replace").rstrip()
            self.lines.append(line)
            if self.forward:
                self.forward(level, line)

        self._cb = _LOGCB(on_log)  # keep a reference: Genie calls it until freed
        status = lib.GenieLog_create(None, self._cb, self.level, ctypes.byref(self.handle))
        if status:
            raise UserError(f"libGenie could not create a logger: {describe(status)}.", "Reinstall onnxruntime-qnn.")

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.lines[-n:])

    def free(self) -> None:
        if self.handle.value:
            load().GenieLog_free(self.handle)
            self.handle = H()


def validate_config(config_json: str, log_level: int = 3) -> tuple[int, list[str]]:
    """libGenie's verdict on a dialog config: (status, its log lines). 0 means valid."""
    lib = load()
    log = Logger(level=log_level)
    cfg = H()
    status = lib.GenieDialogConfig_createFromJson(config_json.encode(), ctypes.byref(cfg))
    if cfg.value:
        lib.GenieDialogConfig_free(cfg)
    lines = list(log.lines)
    log.free()
    return status, lines


class Dialog:
    """One Genie dialog (basic): create from a config, query with streamed text, abort, profile.

    Genie is not thread-safe per dialog: call `query` from one thread; `abort` may come from another.
    """

    def __init__(self, config_json: str, log_level: int = 2, on_log: Callable[[int, str], None] | None = None,
                 profile: bool = True) -> None:
        self.lib = load()
        self.log = Logger(level=log_level, forward=on_log)
        self.handle, self.profile = H(), H()
        cfg = H()
        status = self.lib.GenieDialogConfig_createFromJson(config_json.encode(), ctypes.byref(cfg))
        if status:
            self.log.free()
            raise GenieError("The Genie config was rejected", status, self.log)
        try:
            self.lib.GenieDialogConfig_bindLogger(cfg, self.log.handle)
            if profile and self.lib.GenieProfile_create(None, ctypes.byref(self.profile)) == 0:
                self.lib.GenieDialogConfig_bindProfiler(cfg, self.profile)
            status = self.lib.GenieDialog_create(cfg, ctypes.byref(self.handle))
        finally:
            self.lib.GenieDialogConfig_free(cfg)
        if status:
            self.close()
            raise GenieError("Genie could not create the dialog", status, self.log)

    def set_max_tokens(self, n: int) -> None:
        self.lib.GenieDialog_setMaxNumTokens(self.handle, n)

    def query(self, prompt: str, on_text: Callable[[str, str], None]) -> int:
        """Run one query; `on_text(text, sentence_code)` gets each piece as Genie produces it. Returns status."""

        def cb(resp: bytes | None, code: int, _ud: object) -> None:
            on_text(resp.decode("utf-8", errors="replace") if resp else "", SENTENCE.get(code, str(code)))

        self._qcb = _QUERYCB(cb)
        return int(self.lib.GenieDialog_query(self.handle, prompt.encode("utf-8"), 0, self._qcb, None))

    def abort(self) -> None:
        if self.handle.value:
            self.lib.GenieDialog_signal(self.handle, ACTION_ABORT)

    def reset(self) -> None:
        self.lib.GenieDialog_reset(self.handle)

    def apply_lora(self, name: str, engine: str = "primary") -> None:
        """Switch the dialog to the bundle's LoRA adapter `name` (Genie fills the graphs' adapter inputs from its
        files); the next query answers with it."""
        status = int(self.lib.GenieDialog_applyLora(self.handle, engine.encode(), name.encode()))
        if status:
            raise GenieError(f"Genie could not apply the LoRA adapter {name!r}", status, self.log)

    def set_lora_strength(self, tensor: str, value: float, engine: str = "primary") -> None:
        status = int(self.lib.GenieDialog_setLoraStrength(self.handle, engine.encode(), tensor.encode(), value))
        if status:
            raise GenieError(f"Genie could not set the LoRA strength {tensor} to {value}", status, self.log)

    def profile_json(self) -> str | None:
        if not self.profile.value:
            return None
        keep: list[object] = []

        def alloc(size: int, out: object) -> None:
            buf = ctypes.create_string_buffer(size)
            keep.append(buf)
            out[0] = ctypes.cast(buf, ctypes.c_char_p)  # type: ignore[index]

        cb = _ALLOC(alloc)
        js = ctypes.c_char_p()
        if self.lib.GenieProfile_getJsonData(self.profile, cb, ctypes.byref(js)) or not js.value:
            return None
        return js.value.decode("utf-8", errors="replace")

    def close(self) -> None:
        """Free the dialog (this ends the profile's query events), keep the profile until `free_profile`."""
        if self.handle.value:
            self.lib.GenieDialog_free(self.handle)
            self.handle = H()

    def free_profile(self) -> None:
        if self.profile.value:
            self.lib.GenieProfile_free(self.profile)
            self.profile = H()
        self.log.free()


class GenieError(UserError):
    def __init__(self, what: str, status: int, log: Logger) -> None:
        tail = log.tail()
        super().__init__(f"{what}: status {describe(status)}." + (f"\nGenie's log:\n{tail}" if tail else ""),
                         _fix(status, log.lines))
        self.status = status


# a command that has the option (`chat` has none): the same bundle through genie-t2t-run's stand-in, Genie's log shown
VERBOSE_FIX = ("`npustudio genie-run -c BUNDLE/genie_config.json -p hi --log verbose` shows Genie's and QNN's full "
               "log")


def _fix(status: int, lines: list[str]) -> str:
    text = "\n".join(lines)
    if status in (-7, -8, -9, -4):
        if not text.strip():  # Genie refused the config without a word: say what the status means instead
            return (f"Genie gave no message with it ({describe(status)}): rebuild the bundle with `npustudio bundle` "
                    "(a hand-edited genie_config.json must follow Genie's schema); " + VERBOSE_FIX + ".")
        return "Fix genie_config.json as Genie's message says (or rebuild the bundle with `npustudio bundle`)."
    if "Shared weights buffer" in text:
        return "Weight-shared binaries do not run on the x86 simulator: compile for the simulator (one binary " \
               "per graph)."
    if "Failed to find available PD" in text:  # every context of a dialog lives in one HTP protection domain
        return ("The bundle's context binaries together do not fit in one HTP protection domain (a 32-bit "
                f"address space: about {PD_BUDGET_BYTES / 2**30:.0f} GiB of binaries in all): each graph of a part "
                "carries its own copy of the part's weights. For a phone, compile with --weight-sharing (one copy "
                "per part; the x86 simulator cannot load such binaries); on the simulator, bundle with "
                "--token-graphs-only (half the contexts: the prompt is read one token at a time).")
    if "Non-identical quantization" in text:
        return "The AR-N and AR-1 graphs disagree on an I/O encoding: re-run the compile stage."
    if "No such file" in text or "Could not open" in text or "not found" in text.lower():
        return "A file named in genie_config.json is missing: check the bundle folder."
    return VERBOSE_FIX[0].upper() + VERBOSE_FIX[1:] + "."
