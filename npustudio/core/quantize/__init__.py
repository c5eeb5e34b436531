"""Quantize stage (AIMET quantsim on the adapted graphs). So far: the quantized op definitions."""
