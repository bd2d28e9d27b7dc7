"""Pictures of a plan: ``dynshard.explain(...).save_html(path)`` writes one self-contained page."""

from .page import Section, render
from .communication import Traced
from .memory import Measured

__all__ = ["Section", "render", "Traced", "Measured"]
