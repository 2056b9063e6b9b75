"""NxDI's `modules.padding`: pad a tensor to a shape and cut it back."""

from nxdi.shell.tensor_padding import pad_tensor, pad_with_first_batchline, unpad_tensor

__all__ = ["pad_tensor", "pad_with_first_batchline", "unpad_tensor"]
