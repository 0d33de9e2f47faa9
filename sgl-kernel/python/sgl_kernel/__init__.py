"""sgl_kernel: Triton kernels for the DeepSeek-V4 engine.

One op per file, each with a torch reference (`<op>_ref`) of the same signature beside it; no engine imports.
The kernels arrive with the GPU compressed-attention work; until then this package holds only its skeleton.
"""

__version__ = "0.1.0.dev0"
