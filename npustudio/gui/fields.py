"""Widgets made from a stage option's field (core/stage_options.py): its range, default, choices and help come
from the field, so the window declares none of them itself (tests/test_contracts.py holds it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from PySide6.QtWidgets import QCheckBox, QComboBox, QLineEdit, QSpinBox, QWidget

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


Options = TypeVar("Options", bound=BaseModel)
W = TypeVar("W", bound=QWidget)


class Form(Generic[Options]):
    """A page's widgets bound to fields of one options model, so the page maps options to widgets and back in one
    place: `values()` is what the user set, by field name (for `Project.rerun_options`), `show(options)` sets
    each widget from the options a stage ran with. The widgets are made from their fields (`spin`, `combo`,
    `check`) or bound as made (`bind`)."""

    def __init__(self, model: type[Options]) -> None:
        self.model = model
        self.widgets: dict[str, QWidget] = {}

    def spin(self, name: str, step: int = 1) -> QSpinBox:
        return self.bind(name, spin(self.model, name, step))

    def combo(self, name: str, labels: Mapping[Any, str] | None = None) -> QComboBox:
        return self.bind(name, combo(self.model, name, labels))

    def check(self, name: str, text: str) -> QCheckBox:
        """A check box for the yes/no field, at its default, its description as the tooltip."""
        box = QCheckBox(text)
        box.setChecked(bool(default(self.model, name)))
        box.setToolTip(so.help_of(self.model, name) or "")
        return self.bind(name, box)

    def bind(self, name: str, widget: W) -> W:
        if name not in self.model.model_fields:
            raise ValueError(f"{self.model.__name__} has no field {name!r}")
        self.widgets[name] = widget
        return widget

    def values(self) -> dict[str, Any]:
        return {name: _value(w) for name, w in self.widgets.items()}

    def show(self, options: Options) -> None:
        """Each widget set from `options`, in the order they were bound (a choice that enables or resets another
        widget comes first)."""
        for name, w in self.widgets.items():
            _show(w, getattr(options, name))


def _value(w: QWidget) -> Any:
    if isinstance(w, QSpinBox):
        return w.value()
    if isinstance(w, QComboBox):
        return w.currentData()
    if isinstance(w, QCheckBox):
        return w.isChecked()
    if isinstance(w, QLineEdit):
        return w.text()
    raise TypeError(f"a {type(w).__name__} is not an option's widget")


def _show(w: QWidget, v: Any) -> None:
    if isinstance(w, QSpinBox):
        w.setValue(v)
    elif isinstance(w, QComboBox):
        w.setCurrentIndex(max(0, w.findData(v)))
    elif isinstance(w, QCheckBox):
        w.setChecked(bool(v))
    elif isinstance(w, QLineEdit):
        w.setText(str(v))
    else:
        raise TypeError(f"a {type(w).__name__} is not an option's widget")


def limit_context(box: QSpinBox, project: Any) -> None:
    """A context-length box held to what the project's model takes exactly (`config_audit.max_context`), saying
    why in its tooltip: a longer one is refused by the stage with a fix naming a CLI flag, not this box."""
    from ..core import stages
    from ..core.config_audit import max_context
    from ..core.stage_options import AdaptOptions

    high = so.int_range(AdaptOptions, "cl")[1]
    rec = project.record(stages.MODEL) if project is not None else None
    limit, why = max_context(rec.result.card) if rec is not None else (None, "")
    box.setMaximum(min(high, limit) if limit else high)  # clamps the value too
    help_ = so.help_of(AdaptOptions, "cl") or ""
    box.setToolTip(f"{help_}\nAt most {limit}: {why}." if limit else help_)
