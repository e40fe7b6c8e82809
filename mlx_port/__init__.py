"""DFlash block-diffusion speculative decoding on MLX: convert a draft, then generate with any mlx-lm target.

from mlx_port import load, load_draft, stream_generate
model, tokenizer = load(TARGET)
draft = load_draft("draft-mlx")
for r in stream_generate(model, draft, tokenizer, prompt, block_size=16, max_tokens=256):
    print(r.text, end="")
"""

from .generate import GenerationResponse, generate, stream_generate
from .model import Model, ModelArgs
from .utils import load, load_draft

__all__ = ["GenerationResponse", "Model", "ModelArgs", "generate", "load", "load_draft", "stream_generate"]
