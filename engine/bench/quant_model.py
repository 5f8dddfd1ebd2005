"""`python -m tokenmill.engine.bench.quant_model --out FILE.gguf`: a random Llama GGUF, quantized, for the
quantized-model benchmarks (docs/benchmarks.md): loading peak (load_peak.py) and serving against llama.cpp
(`tokenmill bench peers --models FILE --engines tokenmill,llama.cpp`). Not a test fixture: the 1B preset is ~620 MB and takes minutes.

The tokenizer (vocabulary, merges, chat template) is the bundled SmolLM2's, copied from its GGUF, so
tokenmill and llama.cpp both serve the file as it is. Tensors are drawn (N(0, 0.02), norms 1) and quantized
one at a time (gguf_quantize.py: numpy, no llama.cpp), then written after a header that lists them all,
so memory holds one tensor, not the model.

  python -m tokenmill.engine.bench.quant_model --out /tmp/llama-1b-q4k.gguf               # 1.07B, Q4_K
  python -m tokenmill.engine.bench.quant_model --out m.gguf --preset small --type Q6_K
  python -m tokenmill.engine.bench.quant_model --out /tmp/llama-1b-q4km.gguf --type Q4_K_M  # the usual mix

Q4_K_M is not a tensor type but the mix most GGUF downloads are: Q4_K, with Q6_K for the output (here the
tied embedding) and for attn_v and ffn_down in the first and last eighth of the layers and every third
layer between (llama.cpp's rule for that file type).
"""

import argparse
import pathlib
import time

import numpy as np

# hidden, intermediate, layers, heads, kv heads: "1b" is Llama-3.2-1B's shape with SmolLM2's 49,152-token
# vocabulary: 1.074B parameters (tied embedding).
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "1b": (2048, 8192, 16, 32, 8),
    "small": (512, 1536, 4, 8, 4),
}


def _tensors(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = hidden // heads
    out = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    for i in range(layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (hidden,)),
            (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden)),
            (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden)),
            (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden)),
            (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim)),
            (f"blk.{i}.ffn_norm.weight", (hidden,)),
            (f"blk.{i}.ffn_gate.weight", (inter, hidden)),
            (f"blk.{i}.ffn_up.weight", (inter, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, inter)),
        ]
    return out


def tensor_type(name: str, type_name: str, layers: int) -> str:
    """The GGUF type of 2-D tensor `name`: type_name itself, or its pick in a mix (Q4_K_M)."""
    if type_name != "Q4_K_M":
        return type_name
    if name == "token_embd.weight":  # tied: it is also the output
        return "Q6_K"
    if name.endswith((".attn_v.weight", ".ffn_down.weight")):
        i = int(name.split(".")[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_model(out: pathlib.Path, preset: str, type_name: str, seed: int = 0) -> dict[str, int]:
    """Write the GGUF; returns {"parameters": .., "bytes": ..}."""
    import gguf
    from tokenmill.engine.bench.gguf_quantize import quantize
    from tokenmill.engine.model.bundled import bundled_gguf_path

    hidden, inter, layers, heads, kv_heads = PRESETS[preset]
    src = gguf.GGUFReader(str(bundled_gguf_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random-llama-{preset}-{type_name}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    specs = _tensors(hidden, inter, layers, heads, kv_heads, vocab)
    for name, shape in specs:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4, raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            qtype = gguf.GGMLQuantizationType[tensor_type(name, type_name, layers)]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = (shape[0], shape[1] // block * size)  # gguf-py takes a quantized tensor's shape in bytes
            w.add_tensor_info(name, raw, np.dtype(np.uint8), raw[0] * raw[1], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    params = total = 0
    for name, shape in specs:  # in the header's order
        if len(shape) == 1:
            data = np.ones(shape, dtype=np.float32)
        else:
            drawn = rng.standard_normal(shape, dtype=np.float32) * 0.02
            data = np.ascontiguousarray(quantize(drawn, tensor_type(name, type_name, layers)))
        w.write_tensor_data(data)
        params += int(np.prod(shape))
        total += data.nbytes
    w.close()
    return {"parameters": params, "bytes": total}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenmill.engine.bench.quant_model", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--type", default="Q4_K", help="GGUF type of every 2-D tensor (default Q4_K), or Q4_K_M (a mix)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    info = write_model(args.out, args.preset, args.type, args.seed)
    print(f"{args.out}: {info['parameters']:,} parameters, {info['bytes'] / 1e6:.1f} MB of tensors "
          f"({8 * info['bytes'] / info['parameters']:.2f} bits per weight), {time.perf_counter() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
