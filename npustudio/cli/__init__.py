"""Headless entry points for every stage. `npustudio` with no arguments opens the desktop app."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
