"""sgl_kernel: Triton kernels for the DeepSeek-V4 engine (no engine imports).

One op per file (dsv4_<op>.py), each with a torch reference `<op>_ref` of the same signature, re-exported beside
it. The references and the cache-row layouts live in Triton-free modules, dsv4_attention_ref.py and
dsv4_formats_ref.py: the engine encodes its cache rows and runs its torch attention backend with them, on machines
without Triton too. The routed experts have one front door, dsv4_moe.py: it picks among the MoE's path modules
(dsv4_moe_gemv, dsv4_moe_planes, dsv4_moe_general, dsv4_moe_dense), which share their types through dsv4_moe_common
and never import the door.
"""

__version__ = "0.1.0.dev0"
