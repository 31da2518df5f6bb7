"""LoRA adapters through the server with the official openai client: `model` names an adapter
and gets that adapter's greedy text (equal to the engine's own), /v1/models lists each adapter
with its parent, adapters load and unload over HTTP (only when allowed), and an unknown model
is a 404 as OpenAI answers it."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "lora"))
from lora_util import peft_tensors, write_peft  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two rank-8 adapters for SmolLM2, made from random arrays (the weights' shapes read from
    the model's own parameters)."""
    from jaxinfer.llm import LLM

    tmp = tmp_path_factory.mktemp("adapters")
    llm = LLM(MODEL, max_seq_len=128, max_num_seqs=4, max_loras=2, max_lora_rank=8)
    shapes = {}
    for i, lp in enumerate(llm.params.layers):
        for module, field in (("q_proj", "wq"), ("v_proj", "wv"), ("down_proj", "w_down")):
            kind = "mlp" if module == "down_proj" else "self_attn"
            fan_in, fan_out = getattr(lp, field).shape
            shapes[f"model.layers.{i}.{kind}.{module}.weight"] = np.zeros((fan_out, fan_in),
                                                                          np.float32)
    paths = {}
    for seed, name in enumerate(("french", "pirate")):
        tensors = peft_tensors(shapes, {"q_proj", "v_proj", "down_proj"}, r=8, seed=seed,
                               std=0.05)
        paths[name] = write_peft(str(tmp / name), tensors, 8, 16.0,
                                 ("q_proj", "v_proj", "down_proj"))
    return llm, paths


@pytest.fixture(scope="module")
def lora_server(adapters):
    from jaxinfer.serve import ServeConfig, ServerThread

    llm, paths = adapters
    srv = ServerThread(llm, ServeConfig(MODEL, lora_modules={"french": paths["french"]},
                                        allow_runtime_lora=True)).start()
    yield srv
    srv.stop(timeout_s=60)


@pytest.fixture(scope="module")
def api(lora_server):
    import openai

    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _engine_text(srv, lora):
    from jaxinfer.engine.request import SamplingParams

    fut = srv.state.engine.call(lambda llm: llm.generate(
        PROMPT, SamplingParams(max_tokens=12), lora=lora)[0].text)
    return fut.result(timeout=120)


def test_model_selects_the_adapter(api, lora_server):
    got = api.completions.create(model="french", prompt=PROMPT, max_tokens=12, temperature=0)
    base = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == _engine_text(lora_server, "french")
    assert base.choices[0].text == _engine_text(lora_server, None)
    assert got.choices[0].text != base.choices[0].text
    models = {m.id: m for m in api.models.list().data}
    assert set(models) == {MODEL, "french"}
    assert models["french"].parent == MODEL


def test_load_use_unload_over_http(api, lora_server, adapters, helpers):
    import openai

    _, paths = adapters
    raw = helpers.Raw(lora_server.url)
    status, _, body = raw.request("POST", "/v1/load_lora_adapter",
                                  {"lora_name": "pirate", "lora_path": paths["pirate"]})
    assert status == 200 and "pirate" in body
    got = api.chat.completions.create(model="pirate", max_tokens=10, temperature=0,
                                      messages=[{"role": "user", "content": "Hello!"}])
    assert got.choices[0].message.content
    status, _, body = raw.request("POST", "/v1/load_lora_adapter",
                                  {"lora_name": "pirate", "lora_path": paths["pirate"]})
    assert status == 400 and "already loaded" in body["error"]["message"]
    status, _, body = raw.request("POST", "/v1/load_lora_adapter",
                                  {"lora_name": "x", "lora_path": "/nonexistent"})
    assert status == 400 and body["error"]["param"] == "lora_path"
    status, _, _ = raw.request("POST", "/v1/unload_lora_adapter", {"lora_name": "pirate"})
    assert status == 200
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="pirate", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    status, _, body = raw.request("POST", "/v1/unload_lora_adapter", {"lora_name": "pirate"})
    assert status == 404


def test_runtime_loading_is_off_by_default(lora_server, adapters, helpers):
    from jaxinfer.serve.app import ServeConfig

    _, paths = adapters
    assert ServeConfig(MODEL).allow_runtime_lora is False
    lora_server.state.cfg.allow_runtime_lora = False
    try:
        status, _, body = helpers.Raw(lora_server.url).request(
            "POST", "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": paths["pirate"]})
        assert status == 403 and "--allow_runtime_lora" in body["error"]["message"]
    finally:
        lora_server.state.cfg.allow_runtime_lora = True
