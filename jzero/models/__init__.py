"""Models that ship with jzero (the default job's GPT)."""

from jzero.models.gpt import GPT, GPTConfig, lm_loss

__all__ = ["GPT", "GPTConfig", "lm_loss"]
