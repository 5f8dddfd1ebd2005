"""Checkpoints stored in bf16 and fp16 (the format of nearly every Hub model) as the engine's inputs.

Every other test loads fp32 weights that are dequantized GGUF blocks (the bundled model's conversion),
so the integer "codes" path is taken everywhere. Here the same model, and tiny random ones, are stored
in bf16/fp16 (tests/half_checkpoints.py, tests/tiny_models.py) and loaded by the engine and by
transformers from the same files:
- served in fp32, token for token the same greedy tokens as transformers in fp32 on CPU (the upcast is
  exact, so the two compute with the same weights);
- served in the file's own dtype, no less accurate than transformers in that dtype (the rounding is
  the dtype's, not ours), and every free-running greedy token transformers' choice in that dtype on the
  same prefix, or within the dtype's own rounding of it;
- the codes search finds integer blocks only where they rebuild the weight bit for bit, and a half
  checkpoint served in its dtype is loaded in that dtype, not through fp32 for codes.
"""

import json
import pathlib
import struct

import pytest
import torch
from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.layers.cpu_gemm_policy import bf16_codes_wanted
from tokenmill.engine.layers.linear import Linear
from tokenmill.engine.layers.weight_codes import BLOCK, find_weight_codes
from tokenmill.engine.worker.cpu_weights import plan_weights
from tokenmill.kernels import cpu as cpu_kernels

from tests.half_checkpoints import HALF_DTYPES, SAFETENSORS_DTYPE, cast_checkpoint, safetensors_dtypes
from tests.test_engine_generate import MAX_TOKENS, PROMPTS, hf_greedy, run_tokens
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
HALF = list(HALF_DTYPES)
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}  # stored bits after the leading one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# Teacher-forced text: every prefix's next token is compared, which a free-running greedy run cannot do
# once two candidates are near-tied and the runs part.
TEXT = (
    "The river rose in the night, and by morning the lower fields were under water. The farmers gathered "
    "at the mill to decide what to do. Some wanted to build a wall of sandbags along the bank; others "
    "said the water would only go around it. The miller, who had seen three floods, told them to move "
    "the animals to the hill first and argue about the wall afterwards."
)


def _ops_or_skip() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("the codes search is a C++ op: the CPU kernels are not built here")


def _hf(model_dir: pathlib.Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_logprobs(model_dir: pathlib.Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of ids, one forward pass: row i is the
    distribution of the token after ids[: i + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(_hf(model_dir, dtype)(torch.tensor([ids])).logits[0].float(), -1)


def _engine_next(llm: LLM, prefixes: list[list[int]]) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = llm.generate(prompt_token_ids=prefixes, sampling_params=params, use_tqdm=False)
    return [dict(o.outputs[0].logprobs[0]) for o in outs]  # token id -> logprob, the top 5


def half_agreement(
    model_dir: pathlib.Path, ids: list[int], half: torch.dtype, prefixes: list[list[int]],
    want: list[dict[int, float]], got: list[dict[int, float]],
) -> tuple[int, list[float], int, float]:
    """The half dtype's own error, as transformers has it on the same file, beside the engine's: top-1
    agreement with fp32 over every prefix and the mean |logprob difference| over fp32's top 5. want/got:
    the fp32 and half engines' _engine_next over `prefixes` (each a prefix of ids).
    Returns (transformers top-1, transformers' differences, engine top-1, engine mean difference)."""
    exact, rounded = _hf_logprobs(model_dir, ids, torch.float32), _hf_logprobs(model_dir, ids, half)
    rows = torch.tensor([len(p) - 1 for p in prefixes])
    hf_top1 = int((rounded[rows].argmax(-1) == exact[rows].argmax(-1)).sum())
    hf_diff = [abs(float(exact[r, t] - rounded[r, t])) for r, a in zip(rows.tolist(), want, strict=True) for t in a]
    our_top1 = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(want, got, strict=True))
    our_diff = [abs(a[t] - b[t]) for a, b in zip(want, got, strict=True) for t in a.keys() & b.keys()]
    return hf_top1, hf_diff, our_top1, sum(our_diff) / len(our_diff)


def _engine_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.worker.runner.model


# ---- the files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_the_cast_folder_is_stored_as_hub_repos_are(bundled_checkpoint, bundled_model_dir, dtype) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = bundled_checkpoint(dtype)
    stored = safetensors_dtypes(folder)
    source = safetensors_dtypes(bundled_model_dir)
    assert stored.keys() == source.keys() and set(source.values()) == {"F32"}
    assert set(stored.values()) == {SAFETENSORS_DTYPE[dtype]}
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    assert AutoConfig.from_pretrained(folder).dtype == HALF_DTYPES[dtype]  # transformers reads it so
    for name in TOKENIZER_FILES:
        assert (folder / name).read_bytes() == (bundled_model_dir / name).read_bytes(), name
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert json.loads(f.read(n))["__metadata__"] == {"format": "pt"}  # as transformers writes
    # Each value is its fp32 source rounded to the nearest: within half a unit in the last place (relative
    # 2^-(mantissa bits + 1)), plus half of fp16's smallest subnormal for values below its normal range.
    floor = 2.0**-25 if dtype == "float16" else 0.0
    with safe_open(str(bundled_model_dir / "model.safetensors"), "pt") as src, \
            safe_open(str(folder / "model.safetensors"), "pt") as dst:
        for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            want, got = src.get_tensor(key), dst.get_tensor(key)
            err = (got.float() - want).abs()
            assert bool((err <= want.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1) + floor).all()), key
            # The norms are bf16 values already (SmolLM2 was published in bf16; the GGUF kept them in
            # F32), so only the dequantized blocks need rounding.
            if key != "model.norm.weight":
                assert bool((err > 0).any()), f"{key}: nothing was rounded, so nothing was cast"


def test_cast_refuses_what_it_cannot_store(tmp_path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"a.weight": torch.tensor([1.0, 7.0e4])}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'a.weight' has values beyond float16's range \(65504"):
        cast_checkpoint(src, tmp_path / "fp16", "float16")
    cast_checkpoint(src, tmp_path / "bf16", "bfloat16")  # bf16 has fp32's range
    with pytest.raises(ValueError, match=r"dtype must be one of 'bfloat16', 'float16'; got 'int8'"):
        cast_checkpoint(src, tmp_path / "x", "int8")
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors"):
        cast_checkpoint(tmp_path / "x", tmp_path / "y", "bfloat16")


# ---- which path the weights take -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_a_half_checkpoint_served_in_half_is_loaded_in_half_not_through_fp32(bundled_checkpoint, dtype) -> None:
    served = HALF_DTYPES[dtype]
    for stored in HALF:
        plan = plan_weights(CPU, served, bundled_checkpoint(stored), world_size=1)
        assert (plan.load_dtype, plan.keep_codes, plan.cache_codes) == (served, False, False), (stored, plan)
    # The fp32 GGUF conversion, by contrast, goes through fp32 for its codes where the CPU runs them.
    gguf = plan_weights(CPU, served, bundled_checkpoint("float32"), world_size=1)
    assert gguf.keep_codes == (dtype == "bfloat16" and bf16_codes_wanted(CPU, served))


@pytest.mark.parametrize("dtype", HALF)
def test_codes_are_found_in_a_half_checkpoint_only_where_they_rebuild_it_exactly(bundled_checkpoint, dtype) -> None:
    """The fp32 path searches every 2-D weight for integer blocks (weight_codes.py). A bf16/fp16 cast of
    dequantized Q4_1/Q8_0 blocks is no longer scale * code + min exactly; whatever the search keeps must
    still rebuild the weight bit for bit, checked here outside the C++ op."""
    from safetensors import safe_open

    _ops_or_skip()
    counts = {}
    for stored in ("float32", dtype):
        found = total = 0
        with safe_open(str(bundled_checkpoint(stored) / "model.safetensors"), "pt") as f:
            for key in f.keys():
                w = f.get_tensor(key).float()
                if w.dim() != 2:
                    continue
                total += 1
                codes = find_weight_codes(w)
                if codes is None:
                    continue
                found += 1
                rebuilt = torch.addcmul(codes.mins.repeat_interleave(BLOCK, 1), codes.codes.float(),
                                        codes.scales.repeat_interleave(BLOCK, 1))
                assert torch.equal(rebuilt, w), f"{stored} {key}: codes kept that do not rebuild the weight"
        counts[stored] = (found, total)
    # The control: the GGUF conversion's weights are all integer blocks, so the search works here.
    assert counts["float32"][0] == counts["float32"][1] > 0, counts
    print(f"\ncodes found (of 2-D weights): {counts}")


# ---- parity in fp32 --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_half_checkpoints_served_in_fp32_match_transformers(tmp_path, bundled_model_dir, arch, dtype) -> None:
    model_dir = make_tiny_model(tmp_path, arch, tokenizer_dir=bundled_model_dir, dtype=HALF_DTYPES[dtype])
    assert set(safetensors_dtypes(model_dir).values()) == {SAFETENSORS_DTYPE[dtype]}
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=11)
    assert next(_engine_model(llm).parameters()).dtype == torch.float32
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    assert run_tokens(llm, ids) == hf_greedy(model_dir, ids, MAX_TOKENS)


@pytest.mark.parametrize("dtype", HALF)
def test_the_bundled_model_stored_in_half_served_in_fp32_matches_transformers(bundled_checkpoint, dtype) -> None:
    folder = bundled_checkpoint(dtype)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_kv_blocks=128)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    assert run_tokens(llm, ids) == hf_greedy(folder, ids, MAX_TOKENS)
    # Each projection runs from codes exactly where the search finds lossless ones in its weight (the
    # test above checks those); the rest from fp32 panels.
    if cpu_kernels.load() is not None:
        from safetensors import safe_open

        model = _engine_model(llm)
        layer = model.model.layers[0]
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            w = f.get_tensor("model.layers.0.mlp.down_proj.weight").float()
        down = layer.mlp.down_proj
        assert down.packed_cpu is not None
        assert (down.packed_cpu.codes is not None) == (find_weight_codes(w) is not None)
        with_codes = sum(m.packed_cpu.codes is not None for m in model.model.modules() if isinstance(m, Linear))
        print(f"\n{dtype} checkpoint in fp32: {with_codes} projections on codes")


# ---- served in its own dtype -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_the_bundled_model_served_in_its_stored_half_dtype_is_as_accurate_as_transformers(
        bundled_checkpoint, dtype) -> None:
    folder = bundled_checkpoint(dtype)
    half = HALF_DTYPES[dtype]
    fp32 = LLM(model=str(folder), dtype="float32", max_model_len=512, num_kv_blocks=128)
    ids = fp32.get_tokenizer().encode(TEXT)
    prefixes = [ids[:n] for n in range(4, len(ids))]
    want = _engine_next(fp32, prefixes)  # matches transformers fp32 (the test above)
    prompt_ids = [fp32.engine.tokenize(p) for p in PROMPTS]
    del fp32
    llm = LLM(model=str(folder), dtype=dtype, max_model_len=512, num_kv_blocks=128)
    assert {p.dtype for p in _engine_model(llm).parameters()} == {half}
    got = _engine_next(llm, prefixes)

    # The dtype's own error, as transformers has it on the same file: top-1 agreement with fp32 over every
    # prefix, and the mean |logprob difference| over fp32's top 5.
    hf_top1, hf_diff, our_top1, our_mean = half_agreement(folder, ids, half, prefixes, want, got)
    hf_mean = sum(hf_diff) / len(hf_diff)
    print(f"\n{dtype}: top-1 vs fp32 at {our_top1} of {len(prefixes)} (transformers {hf_top1}); "
          f"mean |logprob diff| {our_mean:.4f} (transformers {hf_mean:.4f})")
    # No worse than transformers in the dtype: at most one more disagreeing position, and a mean error
    # within 1.5x of its (test_model_llama's bound for the same comparison on logits).
    assert our_top1 >= hf_top1 - 1, (our_top1, hf_top1)
    assert our_mean <= 1.5 * hf_mean, (our_mean, hf_mean)

    # Free-running greedy tokens in the dtype: exact equality with transformers' own run holds only where
    # both compute every product with the same rounding, and torch's CPU GEMMs round by batch shape (a row
    # alone and the same row in a batch of 40 differ in all three dtypes on an AVX-512 Xeon; they did not
    # on an AVX2 EPYC), so two correct runs part at the first near-tie. What must hold on every CPU: each
    # token the engine picks is transformers' argmax in the same dtype on the engine's own prefix, or within
    # the dtype's own rounding of it (the largest |logprob difference| transformers shows between fp32 and
    # this dtype on TEXT above). A wrong weight, rope or mask parts by whole nats.
    tolerance = max(hf_diff)
    model = _hf(folder, half)
    ours = run_tokens(llm, prompt_ids)
    worst, exact_tokens = 0.0, 0
    for prompt, tokens in zip(prompt_ids, ours, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1)
        gaps = logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        worst, exact_tokens = max(worst, float(gaps.max())), exact_tokens + int((gaps == 0).sum())
    print(f"{dtype}: {exact_tokens} of {sum(map(len, ours))} greedy tokens are transformers' argmax on the "
          f"same prefix; the largest gap {worst:.4f} (the dtype's rounding {tolerance:.4f})")
    assert worst <= tolerance, (worst, tolerance)
