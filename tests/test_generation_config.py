"""generation_config.json's sampling defaults apply as vLLM applies them: to the fields a
request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty), and its
max_new_tokens caps max_tokens; a request's own values win; `generation_config="vllm"`
ignores the file. Checked against transformers' greedy decode on the same weights."""

import json
import shutil

import httpx2 as httpx
import pytest

from ringserve import LLM, SamplingParams
from ringserve.engine.engine import LLMEngine
from ringserve.model.tiny_models import hf_greedy, hf_model
from ringserve.server import build_app

from helpers import serve_in_thread

RECOMMENDED = {"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.7, "do_sample": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_vocab_model):
    folder = str(tmp_path_factory.mktemp("with_generation_config") / "m")
    shutil.copytree(smol_vocab_model, folder)
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({**RECOMMENDED, "bos_token_id": 1, "eos_token_id": 2}, f)
    return folder


def test_llm_defaults_come_from_generation_config(model):
    reference = hf_model(model)
    prompt = [5, 77, 901, 4000, 12]
    # greedy with the recommended repetition penalty, cut at max_new_tokens
    expected = hf_greedy(reference, prompt, 5, repetition_penalty=1.7)
    # (transformers reads the folder's generation_config.json too: each reference sets its own)
    assert expected != hf_greedy(reference, prompt, 5, repetition_penalty=1.0)  # the penalty shows
    with LLM(model, device="cpu", dtype="float32") as llm:
        assert llm.generate([prompt])[0].token_ids == expected
        assert llm.engine.input_processor.default_params(max_tokens=50).max_tokens == 5  # capped, as vLLM
        mine = llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0))[0]
        assert len(mine.token_ids) == 9  # an explicit SamplingParams is taken as it is
    with LLM(model, device="cpu", dtype="float32", generation_config="vllm") as llm:
        assert llm.engine.input_processor.sampling_defaults == {}
        assert llm.engine.input_processor.default_params() == SamplingParams()


def test_server_requests_take_the_defaults_they_leave_unset(model):
    reference = hf_model(model)
    engine = LLMEngine(options=_options(model))
    prompt = [5, 77, 901, 4000, 12]
    with serve_in_thread(build_app(engine, "m")) as url:
        client = httpx.Client(base_url=url, timeout=60)

        got = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16}).json()
        assert got["usage"]["completion_tokens"] == 5  # max_tokens 16 capped by max_new_tokens
        ids = engine.tokenizer.encode(got["choices"][0]["text"], add_special_tokens=False)
        expected = hf_greedy(reference, prompt, 5, repetition_penalty=1.7)
        assert engine.tokenizer.decode(ids) == engine.tokenizer.decode(expected)
        # the request's own repetition_penalty wins over the recommended one
        plain = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "repetition_penalty": 1.0}
        ).json()
        assert plain["choices"][0]["text"] == engine.tokenizer.decode(
            hf_greedy(reference, prompt, 5, repetition_penalty=1.0)
        )
    engine.close()


def _options(model):
    from ringserve.options import EngineOptions

    return EngineOptions(model=model, device="cpu", dtype="float32")
