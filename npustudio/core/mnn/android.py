"""MNN's Android runtime for a phone: `llm_demo` and the libraries it needs, from an MNN Android build the user has.

It cannot be downloaded here (MNN publishes no such binaries for a command line), so the user points at the
folder of their build (`MNN_ANDROID_ROOT`, or Settings > MNN Android runtime; MNN's `project/android/build_64`
built with `-DMNN_BUILD_LLM=ON`). Before a byte moves it is checked the way a phone's linker would check it:
llm_demo is an arm64 program, and every library it needs (its ELF `DT_NEEDED` entries, and theirs) is either in
the folder or one Android itself provides. What is missing is named.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError

ENV = "MNN_ANDROID_ROOT"
PROGRAM = "llm_demo"
BUILD_HINT = ("an MNN Android build's folder (MNN's project/android/build_64, built with -DMNN_BUILD_LLM=ON), "
              "holding llm_demo and its lib*.so")
# the libraries every Android device provides to an app's native code (the NDK's stable system libraries)
SYSTEM_LIBS = frozenset(f"lib{n}.so" for n in (
    "c", "m", "dl", "log", "android", "z", "EGL", "GLESv1_CM", "GLESv2", "GLESv3", "vulkan", "jnigraphics",
    "mediandk", "nativewindow", "OpenSLES", "OpenMAXAL", "camera2ndk", "neuralnetworks", "sync", "stdc++",
    "aaudio", "amidi", "binder_ndk", "icu"))


def configured() -> Path | None:
    """The runtime folder the user chose (the setting is in the environment once `Settings.apply` ran), if any."""
    value = os.environ.get(ENV, "").strip()
    return Path(value).expanduser() if value else None


def _needed(path: Path) -> list[str]:
    """The libraries an arm64 ELF file names as needed; refused when it is not one."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            if elf["e_machine"] != "EM_AARCH64" or elf.elfclass != 64:
                machine = str(elf["e_machine"]).removeprefix("EM_")
                raise UserError(f"{path} is built for {machine} ({elf.elfclass}-bit), not a phone's arm64-v8a CPU.",
                                f"Point {ENV} at an arm64-v8a build: {BUILD_HINT}.")
            return [str(getattr(tag, "needed", "")) for sec in elf.iter_sections()
                    if isinstance(sec, DynamicSection) for tag in sec.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
    except (ELFError, OSError, ValueError) as e:
        raise UserError(f"{path} is not an Android program or library ({e}).",
                        f"Point {ENV} at {BUILD_HINT}.") from e


def runtime_files(folder: Path) -> list[Path]:
    """llm_demo and every library of `folder` it needs (followed through the libraries' own needs), checked."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"The MNN Android runtime folder {folder} does not exist.",
                        f"Set {ENV} (or Settings > MNN Android runtime) to {BUILD_HINT}.")
    program = folder / PROGRAM
    if not program.is_file():
        raise UserError(f"{folder} has no {PROGRAM}, the program that runs an MNN model on a phone.",
                        f"Point {ENV} at {BUILD_HINT}.")
    files, missing, todo, seen = [program], [], [program], set()
    while todo:
        for name in _needed(todo.pop()):
            if name in seen or name in SYSTEM_LIBS:
                continue
            seen.add(name)
            lib = folder / name
            inside = folder.resolve()
            if "/" in name or "\\" in name or name in (".", "..") or (
                    lib.exists() and inside not in lib.resolve().parents):
                raise UserError(f"{PROGRAM} in {folder} names {name!r} as a library it needs, which is not a file of "
                                "that folder: only the runtime folder's own libraries are pushed to a phone.",
                                f"Use an MNN build whose {PROGRAM} names its libraries by file name, with them "
                                f"in {folder}.")
            if lib.is_file():
                files.append(lib)
                todo.append(lib)
            else:
                missing.append(name)
    if missing:
        raise UserError(f"{PROGRAM} in {folder} needs {', '.join(sorted(missing))}, which the folder does not "
                        "have (a phone has only Android's own libraries).",
                        "Copy them from the same MNN build (libc++_shared.so comes from the Android NDK) into "
                        f"{folder}, or build MNN with MNN_SEP_BUILD=OFF and ANDROID_STL=c++_static.")
    return files
