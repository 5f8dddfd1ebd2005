"""The integer codes found in a model's dequantized weights (layers/weight_codes.py), kept on disk between
starts. (Quantization blocks of 32 weights, not the KV cache's blocks.)

Finding them checks every weight of the model bit for bit (about 1 s of a warm `tokenmill serve` start
on the bundled model, 2 cores); the answer depends only on the weights and on the C++ code that searches,
so it is stored once under ~/.cache/tokenmill/blocks and read back (~170 MB for the bundled model).

The file's name only finds it: it hashes the weight files' paths, sizes and mtimes and the C++ kernels'
build name (new weights or new code: another file). What is served rests on content: each entry carries
the sha256 of the fp32 weight it was found in and of its own codes, scales and mins, and an entry is used
only when both match the weight just loaded and the bytes just read. A file rewritten under the same
mtime, a byte flipped on disk, a model whose loader now builds a weight differently: the entry is refused
(logged), that weight is searched for again, and the file is written anew. (Hashing is cheaper than
rebuilding each weight from its codes in torch and comparing: about half the search's cost here.)
"""

import hashlib
import logging
import os
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tokenmill.engine.model.cache_dirs import tokenmill_cache

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when what is stored changes (2: content digests in the file's metadata)
KEEP_PER_MODEL = 4  # files kept per model folder: checkouts with other kernels may want theirs
DIGEST_CHUNK = 1 << 20  # bytes hashed per task, so that each layer's weight is hashed on several threads


@dataclass(frozen=True, slots=True)
class StoredCodes:
    blocks: object  # WeightCodes
    source: str  # content_digest of the fp32 weight the codes were found in
    digest: str  # content_digest of codes, scales and mins


class WeightCodesCache:
    """Codes of one model's weights, by parameter; find_weight_codes looks weights up by storage."""

    def __init__(self, path: pathlib.Path, names: dict[int, str]) -> None:
        self.path = path
        self.names = names  # data_ptr of a loaded parameter -> its name
        self.stored: dict[str, StoredCodes] = {}  # name -> read from the file, not yet asked for
        self.kept: dict[str, StoredCodes] = {}  # name -> read back and checked against its weight
        self.found: dict[str, StoredCodes] = {}  # name -> searched for in this process
        self.refused: dict[str, str] = {}  # name -> why its stored entry was not used
        self.hits = 0
        self.check_seconds = 0.0  # spent hashing what was read back

    def get(self, weight: torch.Tensor) -> object | None:
        name = self.names.get(weight.data_ptr())
        entry = self.stored.pop(name, None) if name is not None else None
        if entry is None:
            return None
        t0 = time.perf_counter()
        problem = entry_problem(entry, weight)
        self.check_seconds += time.perf_counter() - t0
        if problem is not None:
            logger.warning("weight-block cache %s: %s: %s; searching again", self.path, name, problem)
            self.refused[name] = problem
            return None
        self.hits += 1
        self.kept[name] = entry
        return entry.blocks

    def put(self, weight: torch.Tensor, blocks: object) -> None:
        name = self.names.get(weight.data_ptr())
        if name is not None:
            self.found[name] = StoredCodes(blocks, content_digest(weight), codes_digest(blocks))


def entry_problem(entry: StoredCodes, weight: torch.Tensor) -> str | None:
    """Why a stored entry may not stand for `weight`, or None when it may."""
    b = entry.blocks
    if b.codes.shape != weight.shape:
        return f"codes of shape {tuple(b.codes.shape)} for a weight of shape {tuple(weight.shape)}"
    if codes_digest(b) != entry.digest:
        return "the stored codes do not hash to their recorded digest (the file is damaged)"
    if content_digest(weight) != entry.source:
        return "the loaded weight is not the one the codes were found in (its sha256 differs)"
    return None


def codes_digest(blocks: object) -> str:
    return content_digest(blocks.codes, blocks.scales, blocks.mins)


_pool: ThreadPoolExecutor | None = None


def content_digest(*tensors: torch.Tensor) -> str:
    """sha256 over each tensor's dtype, shape and bytes; the bytes go in as the sha256 of each DIGEST_CHUNK
    (so the answer does not depend on the thread count), hashed in parallel (hashlib lets go of the GIL)."""
    global _pool
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        chunks = [raw[i : i + DIGEST_CHUNK] for i in range(0, len(raw), DIGEST_CHUNK)]
        if len(chunks) > 1 and torch.get_num_threads() > 1:
            if _pool is None:
                _pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="codes-digest")
            parts = _pool.map(lambda c: hashlib.sha256(c).digest(), chunks)
        else:
            parts = (hashlib.sha256(c).digest() for c in chunks)
        for part in parts:
            h.update(part)
    return h.hexdigest()


def cache_path(model_path: pathlib.Path, kernels_build: str) -> pathlib.Path:
    files = sorted(model_path.resolve().glob("*.safetensors"))
    ident = [f"{FORMAT_VERSION}:{DIGEST_CHUNK}", kernels_build] + [f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    model_key = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:16]
    return tokenmill_cache() / "blocks" / f"{model_key}-{key}.safetensors"


def open_cache(model: torch.nn.Module, model_path: pathlib.Path, kernels_build: str) -> WeightCodesCache:
    """The cache for this model's loaded weights, read from disk when a file for them exists (its entries
    are checked one by one as they are asked for: WeightCodesCache.get)."""
    from safetensors import safe_open
    from tokenmill.engine.layers.weight_codes import WeightCodes

    names = {p.data_ptr(): name for name, p in model.named_parameters() if p.dim() == 2}
    cache = WeightCodesCache(cache_path(model_path, kernels_build), names)
    if cache.path.is_file():
        try:
            with safe_open(str(cache.path), framework="pt") as f:
                meta = f.metadata() or {}
                for name in {k.rsplit(".", 1)[0] for k in f.keys()}:
                    source, digest = meta[name].split()  # an entry without digests is damaged
                    blocks = WeightCodes(*(f.get_tensor(f"{name}.{part}") for part in ("codes", "scales", "mins")))
                    cache.stored[name] = StoredCodes(blocks, source, digest)
        except Exception as e:  # a damaged file: search again, and write it anew
            logger.warning("ignoring the weight-block cache %s: %s", cache.path, e)
            cache.stored.clear()
    return cache


def save_cache(cache: WeightCodesCache) -> None:
    """Write the entries of this start (checked ones read back, new ones searched for) when anything was
    searched for; drop older files of the same model folder beyond KEEP_PER_MODEL. Errors only cost the
    next start a search."""
    if cache.hits or cache.refused:
        logger.info(
            "weight-block cache %s: %d entries read back and checked in %.2f s, %d refused, %d searched for",
            cache.path.name, cache.hits, cache.check_seconds, len(cache.refused), len(cache.found),
        )
    if not cache.found:
        return
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, entry in {**cache.kept, **cache.found}.items():
        b = entry.blocks
        tensors.update({f"{name}.codes": b.codes, f"{name}.scales": b.scales, f"{name}.mins": b.mins})
        meta[name] = f"{entry.source} {entry.digest}"
    try:
        cache.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.path.with_name(f".{cache.path.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, cache.path)
        model_key = cache.path.name.split("-", 1)[0]
        others = sorted(cache.path.parent.glob(f"{model_key}-*.safetensors"), key=lambda p: p.stat().st_mtime)
        for old in others[:-KEEP_PER_MODEL]:
            old.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("cannot write the weight-block cache %s: %s", cache.path, e)
