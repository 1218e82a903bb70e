"""The portable Triton kernels shared by musecore's GPU backends. Without a GPU they run only under
Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported; the tests' conftest does
that), on CPU tensors, without bf16: a test facility, never a fallback the plan could pick."""
