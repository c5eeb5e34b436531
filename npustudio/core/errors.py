"""Errors a user can act on: what is wrong, in their terms, and how to fix it."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by input the user can change. `fix` says how."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem}\n  Fix: {self.fix}" if self.fix else self.problem
