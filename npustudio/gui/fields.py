"""Widgets made from a stage option's field (core/stage_options.py): its range, default, choices and help come
from the field, so the window declares none of them itself (tests/test_contracts.py holds it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from PySide6.QtWidgets import QComboBox, QSpinBox

from ..core import stage_options as so


def default(model: type[BaseModel], name: str) -> Any:
    """The field's default: what a page shows before the project has chosen anything."""
    return so.default(model, name)


def spin(model: type[BaseModel], name: str, step: int = 1) -> QSpinBox:
    """A spin box over the whole-number field's range, at its default, its description as the tooltip."""
    box = QSpinBox()
    box.setRange(*so.int_range(model, name))
    box.setSingleStep(step)
    box.setValue(int(default(model, name)))
    box.setToolTip(so.help_of(model, name) or "")
    return box


def combo(model: type[BaseModel], name: str, labels: Mapping[Any, str] | None = None) -> QComboBox:
    """A combo box of the Literal field's values (each shown as `labels[value]` when given), at its default."""
    values = so.choices(model, name)
    if values is None:
        raise ValueError(f"{model.__name__}.{name} is not a choice")
    box = QComboBox()
    for v in values:
        box.addItem((labels or {}).get(v, str(v)), v)
    box.setCurrentIndex(max(0, box.findData(default(model, name))))
    return box
