"""Load a Hugging Face folder's safetensors weights into our model implementation (this rank's shard).
(Finding the folder is resolve.py's job and loading the tokenizer tokenizer.py's: both import no torch.)

Accepted models: an HF folder (config.json, *.safetensors, tokenizer files), a .gguf file (converted
once into the user's cache dir), a hub repo or other URI (model/source.py), or None for the bundled
SmolLM2-135M-Instruct GGUF.
"""

import io
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tokenmill.engine.load_memory import TensorInfo, read_header
from tokenmill.engine.model import sharding
from tokenmill.engine.model.safetensors_stream import read_into, read_tensor, torch_dtype
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
    try:
        return all(t.dtype == "F32" for f in _checkpoint_files(path) for t in read_header(f) if len(t.shape) == 2)
    except (OSError, ValueError):
        return False  # load_weights reports what is wrong with the files


FP32Hooks = dict[str, Callable[[torch.Tensor], bool]]


def load_weights(
    model: torch.nn.Module,
    config: ModelConfig,
    path: pathlib.Path,
    par: "ParallelState | None" = None,
    fp32_hooks: FP32Hooks | None = None,
    skip: set[str] | None = None,
) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; any gap or mismatch is an error.
    skip: checkpoint tensors another loader has consumed, and parameter names it has filled
    (int4_weights.py's codes).
    With a ParallelState, only this rank's slices (sharding.py).

    Streamed (load_memory.py has the bound): parameters are filled one after another, each from the
    checkpoint tensors that make it up, read with plain file reads; a tensor stored in the parameter's
    dtype is read into it directly, another into one buffer of its own that is cast into the parameter
    and dropped. A parameter named in fp32_hooks is first assembled whole in float32 (in the parameter
    itself when that is fp32 on the CPU) and handed to its hook, which may keep what it derives from it,
    never the tensor; then it is cast into the parameter, or freed when the hook returns True (its codes
    stand for it)."""
    from tokenmill.engine.distributed.parallel_state import SINGLE

    par = SINGLE if par is None else par
    params = dict(model.named_parameters())
    targets = sharding.weight_targets(config, par)
    hooks = fp32_hooks or {}
    # Parameter name -> the checkpoint tensors that fill it: (tensor, first row, rows; None unfused).
    sources: dict[str, list[tuple[TensorInfo, int, int | None]]] = {}
    for info in (t for file in _checkpoint_files(path) for t in read_header(file)):
        key = info.name
        if skip is not None and key in skip:
            continue
        if key.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints store the derived RoPE table
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding matrix is the output projection
        target = sharding.local_target(key, config, par, targets)
        if target is None:
            continue  # another pipeline stage's layer or part
        name, first, rows = target
        if name not in params:
            raise ValueError(f"{info.file}: unexpected tensor {key!r} for {config.architecture}")
        sources.setdefault(name, []).append((info, first, rows))
    # Rows of each parameter still unfilled, to report missing weights precisely.
    unfilled = {name: p.shape[0] if p.dim() and name not in (skip or ()) else 0 for name, p in params.items()}
    files: dict[pathlib.Path, io.BufferedReader] = {}
    try:
        for name, param in params.items():  # the model's order: one parameter in flight at a time
            if name not in sources:
                continue
            hook = hooks.get(name)
            in_place = hook is None or (param.dtype == torch.float32 and param.device.type == "cpu")
            whole = param.data if in_place else torch.empty(param.shape, dtype=torch.float32)
            for info, first, rows in sources[name]:
                f = files.get(info.file) or files.setdefault(info.file, open(info.file, "rb"))
                dest = whole if rows is None else whole[first : first + rows]
                unfilled[name] -= _fill(f, info, dest, config, par)
            if hook is not None:
                if hook(whole):  # what the hook derived stands for the parameter: free it now
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                elif not in_place:
                    param.data.copy_(whole)
            del whole
    finally:
        for f in files.values():
            f.close()
    missing = sorted(name for name, rows in unfilled.items() if rows != 0)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"model folder {path} is missing weights for: {shown}")


def _fill(
    f: io.BufferedReader, info: TensorInfo, dest: torch.Tensor, config: ModelConfig, par: "ParallelState"
) -> int:
    """Read one checkpoint tensor into `dest` (its rows of a parameter or of an fp32 stage); the rows
    filled."""
    if par.tp_size == 1:
        if tuple(info.shape) != tuple(dest.shape):
            raise ValueError(
                f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, the model expects {list(dest.shape)}"
            )
        if dest.device.type == "cpu" and dest.dtype == torch_dtype(info) and dest.is_contiguous():
            read_into(f, info, dest)  # stored as served: straight into the parameter, no copy
            return dest.shape[0] if dest.dim() else 1
    tensor = sharding.shard_tensor(info.name, read_tensor(f, info), config, par)
    if tensor.shape != dest.shape:
        raise ValueError(
            f"{info.file}: tensor {info.name!r} has shape {list(tensor.shape)}, the model expects {list(dest.shape)}"
        )
    dest.copy_(tensor)
    return tensor.shape[0] if tensor.dim() else 1


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
    fp32_hooks: "Callable[[torch.nn.Module], FP32Hooks] | None" = None,
) -> torch.nn.Module:
    """Our LlamaForCausalLM with the folder's weights, in `dtype` on `device`, gradients off, eval mode.
    With a ParallelState: this rank's shard only. fp32_hooks(model), called once the model's storage
    exists: the parameters to hand to a hook in float32 before they are cast (load_weights)."""
    from tokenmill.engine.distributed.parallel_state import SINGLE
    from tokenmill.engine.model.gguf_weights import codes_supported, gguf_weights_file, load_gguf_weights
    from tokenmill.engine.model.int4_weights import int4_config, load_int4_linears
    from tokenmill.engine.models.llama import LlamaForCausalLM

    path = pathlib.Path(path)
    config = model_config if model_config is not None else load_model_config(path)
    # Build on the meta device so no random init runs and nothing is allocated twice.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, SINGLE if par is None else par)
    materialize(model, dtype, torch.device(device))
    hooks = None if fp32_hooks is None else fp32_hooks(model)
    par = SINGLE if par is None else par
    codes = codes_supported(torch.device(device), dtype, par.tp_size)
    gguf = gguf_weights_file(path)
    int4 = int4_config(path) if gguf is None else None
    if gguf is not None:  # a GGUF's cache folder: the weights come from the file's blocks
        load_gguf_weights(model, config, gguf, par, codes, hooks)
    elif int4 is not None:  # AWQ / GPTQ: the quantized linears as codes, the rest as tensors
        if par.tp_size > 1:
            raise ValueError(f"{path}: {int4.method} checkpoints are not supported with tensor parallelism")
        consumed = load_int4_linears(model, config, path, int4, par, codes)
        hooks = {**keep_codes_biases(model, codes), **(hooks or {})}
        load_weights(model, config, path, par, hooks, skip=consumed)  # consumed: tensors and parameters
    else:
        load_weights(model, config, path, par, hooks)
    model.requires_grad_(False)
    return model.eval()


def keep_codes_biases(model: torch.nn.Module, codes: bool) -> FP32Hooks:
    """Hooks that keep the fp32 bias of every linear held as codes (the codes kernels add it in fp32)."""
    from tokenmill.engine.layers.linear import Linear

    if not codes:
        return {}
    return {
        f"{name}.bias": module.keep_fp32_bias
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.packed_cpu is not None and module.bias is not None
    }
