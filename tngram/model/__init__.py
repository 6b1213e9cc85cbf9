"""The parameter-golf GPT backbone with pluggable memory."""

from tngram.model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
