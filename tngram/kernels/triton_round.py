"""Rounding to a tensor's dtype inside Triton kernels, the same on the GPU and the interpreter.

`round_to(x, ptr)`: fp32 x rounded to the element type of `ptr` (round to nearest, ties to even,
as torch's casts), returned in fp32, so the store that follows drops only zero bits. bf16 is done
with integer arithmetic because the Triton interpreter (TRITON_INTERPRET=1, how the tests run
kernels without a GPU) truncates a fp32 -> bf16 cast where the GPU rounds; finite values only
(the kernels' inputs are). Other dtypes use the ordinary cast (the interpreter rounds those).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, ptr):
    if ptr.dtype.element_ty == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty).to(tl.float32)


__all__ = ["round_to"]
