from ..engine.draft import Draft, DraftContext, Drafter
from .history import PromptHistory
from .hybrid import HybridDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter


__all__ = ["Draft", "DraftContext", "Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "PromptHistory"]
