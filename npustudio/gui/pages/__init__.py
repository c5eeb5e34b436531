"""The wizard's pages, in order: each a thin view over one core stage."""

from .adapt import AdaptPage
from .compile import CompilePage
from .deploy import DeployPage
from .model import ModelPage
from .quantize import QuantizePage
from .target import TargetPage

PAGES = (ModelPage, TargetPage, AdaptPage, QuantizePage, CompilePage, DeployPage)
__all__ = ["PAGES", "AdaptPage", "CompilePage", "DeployPage", "ModelPage", "QuantizePage", "TargetPage"]
