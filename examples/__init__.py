"""Runnable examples of zlightning: a byte-level GPT (`gpt_model`, torch only) and its Lightning module (`gpt`)."""
