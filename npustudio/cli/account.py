"""The Hugging Face token (system keyring only), the window and its menu entry."""

from __future__ import annotations

import argparse
import getpass
import sys

from ..core.errors import UserError
from .console import err


def cmd_token(a: argparse.Namespace) -> int:
    from ..core import secrets

    if a.action == "set":
        tok = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("Hugging Face token: ")
        if not tok:
            raise UserError("No token given.", "Paste the token from https://huggingface.co/settings/tokens.")
        secrets.set_hf_token(tok)
        err.print("Token stored in the system keyring.")
    elif a.action == "delete":
        secrets.delete_hf_token()
        err.print("Token removed from the system keyring.")
    else:
        err.print("A Hugging Face token is set." if secrets.get_hf_token() else "No Hugging Face token is set.")
        why = secrets.no_keyring()
        if why:
            err.print(f"(No usable system keyring: {why}; only HF_TOKEN can hold a token.)")
    return 0


def cmd_gui(a: argparse.Namespace) -> int:
    from ..core import desktop_libs

    desktop_libs.check()  # before Qt, which would abort the process with a wrong package name
    from ..gui.app import main as gui_main

    return gui_main([a.project] if getattr(a, "project", None) else [])


def cmd_desktop_entry(a: argparse.Namespace) -> int:
    from ..core import desktop_entry

    if a.action == "install":
        w = desktop_entry.install()
        if w.replaced:
            err.print(f"Replaced the entry of the installation in {w.replaced}.")
        err.print(f"Menu entry written: {w.entry}\n  starts: {' '.join(w.exec_argv)}\n  icons: "
                  + ", ".join(str(i) for i in w.icons))
    else:
        gone = desktop_entry.remove()
        err.print(f"Menu entry removed: {gone}" if gone else
                  f"No menu entry to remove ({desktop_entry.entry_path()} does not exist).")
    return 0
