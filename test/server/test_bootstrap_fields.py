"""The request fields of prefill/decode disaggregation (bootstrap_host, bootstrap_port, bootstrap_room, as
sglang-router's PD mode adds them) on /generate, /v1/completions and /v1/chat/completions: one pairing per request
carried to the TokenizerManager and on to the scheduler; a malformed value a 400 naming the field in every mode; a
request without them refused by a prefill or decode server and served whole by a null-mode one. About 2 s."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from test_chat_glue import ScriptedTokenizerManager
from test_tokenizer_manager_rids import pair  # noqa: F401 (the fixture: a real TokenizerManager, a fake scheduler)

from sglang.srt.disaggregation.messages import BootstrapInfo
from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

ROUTER = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}


class RecordingTokenizerManager(ScriptedTokenizerManager):
    """The scripted model, taking /generate's arguments too."""

    async def generate(self, ids, params, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, rid=None,
                       bootstrap=None, **_):
        async for chunk in super().generate(ids, params, return_logprob, logprob_start_len, top_logprobs_num,
                                            bootstrap=bootstrap):
            yield chunk


@pytest.fixture(scope="module", params=["decode", "null"])
def served(request):
    tm = RecordingTokenizerManager()
    args = ServerArgs(model_path="scripted", disaggregation_mode=request.param)
    with TestClient(create_app(tm, args)) as client:
        yield request.param, tm, client


def post(served, path: str, **body):
    _, tm, client = served
    tm.pairings.clear()
    tm.script = "ok"
    body = {"model": "scripted", **body} if path.startswith("/v1") else body
    return client.post(path, json=body)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_the_router_fields_pair_each_request(served):
    mode, tm, _ = served
    expected = (lambda *infos: list(infos)) if mode == "decode" else (lambda *infos: [None] * len(infos))
    assert post(served, "/v1/chat/completions", **CHAT, **ROUTER).status_code == 200
    assert tm.pairings == expected(BootstrapInfo("10.0.0.7", 8998, 2**63 - 1))
    r = post(served, "/v1/chat/completions", **CHAT, n=2, bootstrap_host=["h1", "h1"], bootstrap_port=[None, 9000],
             bootstrap_room=[0, 1])
    assert r.status_code == 200 and tm.pairings == expected(BootstrapInfo("h1", None, 0), BootstrapInfo("h1", 9000, 1))
    r = post(served, "/v1/completions", prompt=["a", "b"], max_tokens=2, bootstrap_host="::1", bootstrap_port=1,
             bootstrap_room=[5, 6])
    assert r.status_code == 200 and tm.pairings == expected(BootstrapInfo("::1", 1, 5), BootstrapInfo("::1", 1, 6))
    r = post(served, "/generate", input_ids=[[3, 4], [5]], sampling_params={"max_new_tokens": 2},
             bootstrap_host=["a", "b"], bootstrap_port=[1, 2], bootstrap_room=[7, 8])
    assert r.status_code == 200 and tm.pairings == expected(BootstrapInfo("a", 1, 7), BootstrapInfo("b", 2, 8))


@pytest.mark.parametrize("fields, param, says", [
    ({"bootstrap_room": "5"}, "bootstrap_room", "integer in [0, 2**63)"),
    ({"bootstrap_room": 2**63}, "bootstrap_room", "integer in [0, 2**63)"),
    ({"bootstrap_room": -1}, "bootstrap_room", "integer in [0, 2**63)"),
    ({"bootstrap_room": True}, "bootstrap_room", "integer in [0, 2**63)"),
    ({"bootstrap_port": 0}, "bootstrap_port", "[1, 65535]"),
    ({"bootstrap_port": 65536}, "bootstrap_port", "[1, 65535]"),
    ({"bootstrap_host": "bad host"}, "bootstrap_host", "hostname or an IP address"),
    ({"bootstrap_host": None}, "bootstrap_host", "missing"),
    ({"bootstrap_room": [1]}, "bootstrap_room", "1 entries for 2 choice(s)"),
])
def test_malformed_fields_are_a_400_naming_the_field(served, fields, param, says):
    body = {**CHAT, **ROUTER, **fields}
    if isinstance(fields.get("bootstrap_room"), list):
        body["n"] = 2
    r = post(served, "/v1/chat/completions", **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.json()["error"]["message"]
    assert served[1].pairings == []  # nothing reached generation


def test_one_room_for_several_requests_is_refused(served):
    r = post(served, "/v1/chat/completions", **CHAT, **ROUTER, n=2)  # a scalar room for two choices
    assert r.status_code == 400 and "one per choice" in r.json()["error"]["message"]
    r = post(served, "/generate", input_ids=[[3], [4]], **{**ROUTER, "bootstrap_room": [9, 9]})
    assert r.status_code == 400 and "same room twice" in r.json()["error"]["message"]


def test_a_pd_server_refuses_requests_without_the_fields(served):
    mode = served[0]
    r = post(served, "/v1/chat/completions", **CHAT)
    r_gen = post(served, "/generate", input_ids=[3], sampling_params={"max_new_tokens": 1})
    r_resp = post(served, "/v1/responses", input="hi", max_output_tokens=2)
    if mode == "null":
        assert (r.status_code, r_gen.status_code, r_resp.status_code) == (200, 200, 200)
        return
    assert r.status_code == r_gen.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    assert "--disaggregation-mode decode" in r.json()["error"]["message"]
    assert r_resp.status_code == 400 and "not served with --disaggregation-mode decode" in r_resp.text


def test_the_pairing_reaches_the_scheduler_on_the_tokenized_request(pair):  # noqa: F811
    tm, scheduler = pair

    async def run():
        stream = tm.generate([3, 4], SamplingParams(max_new_tokens=1), bootstrap=BootstrapInfo("h", None, 12))
        task = asyncio.ensure_future(stream.__anext__())
        sent = await scheduler.next()
        task.cancel()
        plain = tm.generate([3], SamplingParams(max_new_tokens=1))
        task = asyncio.ensure_future(plain.__anext__())
        while not isinstance(other := await scheduler.next(), TokenizedGenerateReqInput):
            pass  # the first request's abort
        task.cancel()
        return sent, other

    sent, other = asyncio.run(run())
    assert (sent.bootstrap_host, sent.bootstrap_port, sent.bootstrap_room) == ("h", None, 12)
    assert (other.bootstrap_host, other.bootstrap_port, other.bootstrap_room) == (None, None, None)
