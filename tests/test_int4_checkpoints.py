"""AWQ and GPTQ int4 checkpoints loaded as their tensors hold them (engine/model/int4_weights.py): one packed
word of each format against a hand-written answer, then the parity rule on tiny models: fp32 logits equal
the dequantized twin's bit for bit, greedy tokens equal transformers' on the twin, bf16 (with Qwen2's
biases) within the bounds test_gguf_direct states; and the refusals name what is unsupported."""

import json
import pathlib

import numpy as np
import pytest
import torch
from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight
from tokenmill.engine.model.gguf_weights import codes_supported
from tokenmill.engine.model.int4_weights import Int4Config, int4_config, unpack
from tokenmill.engine.model.loader import load_model
from tokenmill.engine.model_config import load_model_config
from tokenmill.kernels import cpu as cpu_kernels

from tests.int4_checkpoints import write_int4
from tests.test_model_gguf import TINY_VOCAB
from tests.test_model_llama import _forward_all, _hf_logits, _hf_model
from tests.tiny_models import make_kv_caches, make_tiny_model

WORD = np.array([[0x76543210]], dtype=np.uint32).view(np.int32)  # nibble i holds i


def test_one_awq_word_unpacks_in_autoawqs_column_order() -> None:
    q, z = unpack(Int4Config("awq", 128, False), WORD, WORD)
    # AutoAWQ packs column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i] into nibble i, so columns 0..7 read
    # nibbles 0, 4, 1, 5, 2, 6, 3, 7 (its AWQ_REVERSE_ORDER). Transposed: [out, in].
    assert q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7] and z[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_one_gptq_word_unpacks_rows_in_order_and_zeros_plus_one() -> None:
    q, z = unpack(Int4Config("gptq", 128, True), WORD, WORD)
    assert q[0].tolist() == list(range(8))  # input rows 0..7 of output column 0
    assert z[:, 0].tolist() == list(range(1, 9))  # the "gptq" format stores each zero minus one
    _, z2 = unpack(Int4Config("gptq", 128, False), WORD, WORD)
    assert z2[:, 0].tolist() == list(range(8))


CASES = [("awq", "llama", False), ("gptq", "llama", False), ("gptq", "qwen2", True)]  # qwen2: q/k/v biases


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str, bool], tuple[pathlib.Path, pathlib.Path]]:
    out = {}
    for method, arch, v2 in CASES:
        tmp = tmp_path_factory.mktemp(f"{method}-{arch}")
        hf = make_tiny_model(tmp, arch, vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512)
        write_int4(hf, tmp / "int4", tmp / "ref", method, group=128, v2=v2)
        out[(method, arch, v2)] = (tmp / "int4", tmp / "ref")
    return out


def _decode(model, seq: list[int], prompt: int, dtype: torch.dtype) -> torch.Tensor:
    c = model.config
    kv = make_kv_caches(c.num_hidden_layers, 16, 16, c.num_key_value_heads, c.head_dim, dtype)
    steps = [_forward_all(model, kv, [seq], [[4, 1, 7]], [0], [prompt])[-1:]]
    steps += [_forward_all(model, kv, [seq], [[4, 1, 7]], [i], [1]) for i in range(prompt, len(seq))]
    return torch.cat(steps)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-v2' if c[2] else ''}")
def test_int4_serves_its_codes_with_the_dequantized_twins_logits(checkpoints, case) -> None:
    int4, ref = checkpoints[case]
    ours = load_model(int4, load_model_config(int4), torch.float32, "cpu")
    ours.pack_linears_cpu(blocks=True)  # the fp32 LM head, as the engine packs it (the codes stay)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed_cpu, GroupedPackedWeight) and qkv.weight is None
    assert qkv.packed_cpu.fmt.group == 128
    twin = load_model(ref, load_model_config(ref), torch.float32, "cpu")
    twin.pack_linears_cpu(blocks=True)
    seq = torch.randint(3, TINY_VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    got = _decode(ours, seq, 10, torch.float32)
    assert torch.equal(got, _decode(twin, seq, 10, torch.float32))
    hf = _hf_model(ref)
    torch.testing.assert_close(got, _hf_logits(hf, seq)[9:], rtol=1e-4, atol=1e-4)
    # bf16: the bounds of test_gguf_direct (no worse than transformers' bf16 on the same weights)
    bf = load_model(int4, load_model_config(int4), torch.bfloat16, "cpu")
    if case[1] == "qwen2" and codes_supported(torch.device("cpu"), torch.bfloat16, 1):  # codes add an fp32 bias
        assert bf.model.layers[0].self_attn.qkv_proj.bias_fp32.dtype == torch.float32
    full = _forward_all(bf, make_kv_caches(2, 16, 16, 2, 64, torch.bfloat16), [seq], [[4, 1]], [0], [len(seq)])
    exact, theirs = _hf_logits(hf, seq), _hf_logits(_hf_model(ref, torch.bfloat16), seq)
    agree = lambda x: int((x.argmax(-1) == exact.argmax(-1)).sum())  # noqa: E731
    err = lambda x: (x.log_softmax(-1) - exact.log_softmax(-1)).abs().mean().item()  # noqa: E731
    assert agree(full) >= agree(theirs) and err(full) <= 1.5 * err(theirs), (agree(full), agree(theirs), err(full), err(theirs))


def test_greedy_tokens_equal_transformers_on_the_twin(checkpoints) -> None:
    int4, ref = checkpoints[("awq", "llama", False)]
    ours = load_model(int4, load_model_config(int4), torch.float32, "cpu")
    ours.pack_linears_cpu(blocks=True)
    kv = make_kv_caches(2, 16, 16, 2, 64, torch.float32)
    ids = [7, 99, 13, 200, 41]
    logits = _forward_all(ours, kv, [ids], [[4, 1, 7]], [0], [len(ids)])
    for _ in range(12):  # greedy decode, one token a step, as the engine runs it
        ids.append(int(logits[-1].argmax()))
        logits = _forward_all(ours, kv, [ids], [[4, 1, 7]], [len(ids) - 1], [1])
    hf, expect = _hf_model(ref), ids[:5]
    for _ in range(12):
        expect.append(int(_hf_logits(hf, expect)[-1].argmax()))
    assert ids == expect


def _with_config(folder: pathlib.Path, **changes) -> pathlib.Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unsupported_quantizations_are_refused_by_name(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert int4_config(tmp_path) == Int4Config("awq", 128, False)
    for changes, message in [
        ({"bits": 8}, r"awq with 8-bit weights is not supported; supported: 4 bits"),
        ({"group_size": 48}, r"group_size 48 is not supported; supported: multiples of 32, or -1"),
        ({"version": "gemv"}, r"AWQ version 'gemv' .* supported: version gemm"),
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported; supported: awq, gptq"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
        with pytest.raises(ValueError, match=message):
            int4_config(_with_config(tmp_path, **changes))


def test_act_order_checkpoints_are_refused(checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    int4, _ = checkpoints[("gptq", "qwen2", True)]
    folder = tmp_path / "desc"
    folder.mkdir()
    for f in int4.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = torch.flip(tensors[name], [0]).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj is quantized with act-order \(desc_act"):
        load_model(folder, load_model_config(folder), torch.float32, "cpu")


def test_where_no_codes_kernel_runs_the_weights_are_dequantized_at_load(checkpoints) -> None:
    """fp16 on a CPU (as on a GPU, or without the C++ kernels): each linear's codes dequantized into its
    parameter, equal to the twin's weights cast to the dtype."""
    int4, ref = checkpoints[("gptq", "llama", False)]
    ours = load_model(int4, load_model_config(int4), torch.float16, "cpu")
    twin = load_model(ref, load_model_config(ref), torch.float16, "cpu")
    mine, theirs = dict(ours.named_parameters()), dict(twin.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
