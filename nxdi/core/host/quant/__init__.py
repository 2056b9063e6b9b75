"""Weight quantization: schemes, quantize/dequantize, and the quantized checkpoint layout. Pure.

Not wired into the engine yet: `weights` holds the tensor math, `layout` which checkpoint keys are
quantized and how to check a quantized checkpoint against a scheme before loading it.
"""
