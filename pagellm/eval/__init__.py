"""`pagellm eval`: how well a model (in a mode: quantization, dtype, kernel level) predicts real text."""
