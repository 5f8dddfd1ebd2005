"""Load a Hugging Face folder's safetensors weights into our model implementation (this rank's shard).
(Finding the folder is resolve.py's job and loading the tokenizer tokenizer.py's: both import no torch.)

Accepted models: an HF folder (config.json, *.safetensors, tokenizer files), a .gguf file (converted
once into the user's cache dir), a hub repo or other URI (model/source.py), or None for the bundled
SmolLM2-135M-Instruct GGUF.
"""

import pathlib
from typing import TYPE_CHECKING

import torch
from tokenmill.engine.model import sharding
from tokenmill.engine.model_config import ModelConfig, load_model_config

if TYPE_CHECKING:
    from tokenmill.engine.distributed.parallel_state import ParallelState


def _checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(other)}: only safetensors are loaded)" if other else ""
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weight files{hint}")
    return files


def checkpoint_is_float32(path: pathlib.Path) -> bool:
    """Whether every 2-D tensor of the folder's safetensors files is stored in float32 (a GGUF
    conversion is): read from the files' JSON headers, no tensor data."""
    import json
    import struct

    try:
        for file in _checkpoint_files(path):
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__" and len(entry.get("shape", ())) == 2 and entry.get("dtype") != "F32":
                    return False
    except (OSError, ValueError, struct.error):
        return False  # load_weights reports what is wrong with the files
    return True


def _weight_targets(config: ModelConfig, par: "ParallelState") -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (our fused parameter name, first row, number of rows) within it."""
    q, kv, inter = sharding.local_sizes(config, par)
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
    With a ParallelState, only this rank's slices (sharding.py)."""
    from safetensors import SafetensorError, safe_open
    from tokenmill.engine.distributed.parallel_state import SINGLE

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
                    local = sharding.local_name(key, config, par)
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
                    tensor = sharding.shard_tensor(key, f.get_tensor(key), config, par)
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


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device`, floating ones in `dtype`:
    `model.to(dtype).to_empty(device)` without its torch._refs.empty_like, whose first call imports sympy
    (1.0 s of a warm `tokenmill serve` start). A tensor shared between modules stays shared."""
    new: dict[int, torch.Tensor] = {}  # id of an original -> its replacement
    originals: list[torch.Tensor] = []  # kept alive so that no id is reused while `new` is consulted

    def replace(t: torch.Tensor, as_param: bool) -> torch.Tensor:
        if id(t) not in new:
            originals.append(t)
            dt = dtype if t.is_floating_point() else t.dtype
            empty = torch.empty(t.shape, dtype=dt, device=device)
            new[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if as_param else empty
        return new[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = replace(param, True)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = replace(buf, False)


def load_model(
    path: str | pathlib.Path,
    model_config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    par: "ParallelState | None" = None,
) -> torch.nn.Module:
    """Our LlamaForCausalLM with the folder's weights, in `dtype` on `device`, gradients off, eval mode.
    With a ParallelState: this rank's shard only."""
    from tokenmill.engine.distributed.parallel_state import SINGLE
    from tokenmill.engine.models.llama import LlamaForCausalLM

    path = pathlib.Path(path)
    config = model_config if model_config is not None else load_model_config(path)
    # Build on the meta device so no random init runs and nothing is allocated twice.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, SINGLE if par is None else par)
    materialize(model, dtype, torch.device(device))
    load_weights(model, config, path, par)
    model.requires_grad_(False)
    return model.eval()
