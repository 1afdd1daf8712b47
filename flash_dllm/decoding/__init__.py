"""Pure tensor functions that turn logits at masked slots into committed tokens (no engine state)."""
