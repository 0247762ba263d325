"""Tokens to and from media: the VQ image tokenizer, the action tokens, rendering tokens as frames and videos."""
