"""The integer codes found in a model's dequantized weights (layers/weight_codes.py), kept on disk between
starts. (Quantization blocks of 32 weights, not the KV cache's blocks.)

Finding them checks every weight of the model bit for bit (about 1 s of a warm `tokenmill serve` start
on the bundled model, 2 cores); the answer depends only on the weight files and on the C++ code that
searches, so it is stored once under ~/.cache/tokenmill/blocks and read back (~170 MB for the bundled model, a
tenth of a second from the page cache). The key hashes the weight files' paths, sizes and mtimes and the
C++ kernels' build name (their sources and flags): new weights or new code search again. A damaged or
missing file only means searching again. The worker passes the cache to find_weight_codes while it packs.
"""

import hashlib
import logging
import os
import pathlib

import torch
from tokenmill.engine.model.cache_dirs import tokenmill_cache

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what is stored changes
KEEP_PER_MODEL = 4  # files kept per model folder: checkouts with other kernels may want theirs


class WeightCodesCache:
    """Codes of one model's weights, by parameter; find_weight_codes looks weights up by storage."""

    def __init__(self, path: pathlib.Path, names: dict[int, str]) -> None:
        self.path = path
        self.names = names  # data_ptr of a loaded parameter -> its name
        self.stored: dict[str, object] = {}  # name -> WeightCodes read from the file
        self.found: dict[str, object] = {}  # name -> WeightCodes searched for in this process
        self.hits = 0

    def get(self, weight: torch.Tensor) -> object | None:
        name = self.names.get(weight.data_ptr())
        blocks = self.stored.pop(name, None) if name is not None else None
        if blocks is not None and blocks.codes.shape == weight.shape:
            self.hits += 1
            return blocks
        return None

    def put(self, weight: torch.Tensor, blocks: object) -> None:
        name = self.names.get(weight.data_ptr())
        if name is not None:
            self.found[name] = blocks


def cache_path(model_path: pathlib.Path, kernels_build: str) -> pathlib.Path:
    files = sorted(model_path.resolve().glob("*.safetensors"))
    ident = [f"{FORMAT_VERSION}", kernels_build] + [f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    model_key = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:16]
    return tokenmill_cache() / "blocks" / f"{model_key}-{key}.safetensors"


def open_cache(model: torch.nn.Module, model_path: pathlib.Path, kernels_build: str) -> WeightCodesCache:
    """The cache for this model's loaded weights, read from disk when a file for them exists."""
    from safetensors.torch import load_file
    from tokenmill.engine.layers.weight_codes import WeightCodes

    names = {p.data_ptr(): name for name, p in model.named_parameters() if p.dim() == 2}
    cache = WeightCodesCache(cache_path(model_path, kernels_build), names)
    if cache.path.is_file():
        try:
            tensors = load_file(str(cache.path))
            for name in {k.rsplit(".", 1)[0] for k in tensors}:
                cache.stored[name] = WeightCodes(
                    tensors[f"{name}.codes"], tensors[f"{name}.scales"], tensors[f"{name}.mins"]
                )
        except Exception as e:  # a damaged file: search again, and write it anew
            logger.warning("ignoring the weight-block cache %s: %s", cache.path, e)
            cache.stored.clear()
    return cache


def save_cache(cache: WeightCodesCache) -> None:
    """Write what this process searched for, when it searched (nothing was read back); drop older files
    of the same model folder beyond KEEP_PER_MODEL. Errors only cost the next start a search."""
    if not cache.found or cache.hits:
        return
    from safetensors.torch import save_file

    tensors = {}
    for name, b in cache.found.items():
        tensors.update({f"{name}.codes": b.codes, f"{name}.scales": b.scales, f"{name}.mins": b.mins})
    try:
        cache.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.path.with_name(f".{cache.path.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, cache.path)
        model_key = cache.path.name.split("-", 1)[0]
        others = sorted(cache.path.parent.glob(f"{model_key}-*.safetensors"), key=lambda p: p.stat().st_mtime)
        for old in others[:-KEEP_PER_MODEL]:
            old.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("cannot write the weight-block cache %s: %s", cache.path, e)
