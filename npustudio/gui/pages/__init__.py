"""The wizard's pages: each a thin view over one step of `core.stages.STEPS`, whose order they take."""

from ...core.stages import STEP_NAMES
from .adapt import AdaptPage
from .compile import CompilePage
from .deploy import DeployPage
from .model import ModelPage
from .quantize import QuantizePage
from .target import TargetPage

_BY_STEP = {p.title: p for p in (AdaptPage, CompilePage, DeployPage, ModelPage, QuantizePage, TargetPage)}
PAGES = tuple(_BY_STEP[name] for name in STEP_NAMES)  # a step without its page fails here, at import
__all__ = ["PAGES", "AdaptPage", "CompilePage", "DeployPage", "ModelPage", "QuantizePage", "TargetPage"]
