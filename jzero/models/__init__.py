"""Models that ship with jzero (the default job's GPT; LoRA adapters and their labels)."""

from jzero.models.gpt import GPT, GPTConfig, lm_loss, lora_labels

__all__ = ["GPT", "GPTConfig", "lm_loss", "lora_labels"]
