"""What the tests share: GGUF writers, the diffusers reference drivers, a real ComfyUI server and
its workflows, and the low-VRAM check run under ComfyUI's interpreter."""
