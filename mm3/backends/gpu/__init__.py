"""The GPU back end (CUDA, ROCm, XPU through Triton): fused dequantize-and-multiply kernels over the
GGUF blocks (`kernels`, `triton_gguf`) or over the device layout (`device_layout`, `layout_kernels`,
`layout_fields`, `layout_triton`), which form a weight is held in (`placement`) and which kernels serve it
(`kernel_choice`), the kernels as torch custom ops (`custom_ops`), the frame step replayed from CUDA
graphs (`frame_graphs`) and what a kernel compiles to (`kernel_report`)."""
