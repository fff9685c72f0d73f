from .base import Draft, DraftContext, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter


__all__ = ["Draft", "DraftContext", "Drafter", "ModelDrafter", "NgramDrafter"]
