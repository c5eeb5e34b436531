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


def limit_context(box: QSpinBox, project: Any) -> None:
    """A context-length box held to what the project's model takes exactly (`config_audit.max_context`), saying
    why in its tooltip: a longer one is refused by the stage with a fix naming a CLI flag, not this box."""
    from ..core import stages
    from ..core.config_audit import max_context
    from ..core.results import IntakeResult
    from ..core.stage_options import AdaptOptions

    high = so.int_range(AdaptOptions, "cl")[1]
    rec = project.record(stages.MODEL.name) if project is not None else None
    limit, why = (max_context(rec.result_as(IntakeResult).card) if rec is not None and rec.status == "done"
                  else (None, ""))
    box.setMaximum(min(high, limit) if limit else high)  # clamps the value too
    help_ = so.help_of(AdaptOptions, "cl") or ""
    box.setToolTip(f"{help_}\nAt most {limit}: {why}." if limit else help_)
