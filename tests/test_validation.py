"""Bad input gets a clear status naming the field; the server keeps serving."""
from __future__ import annotations

import asyncio
import hashlib

import grpc
import numpy as np
import pytest

from rollout_proto import rollout_pb2 as pb
from trainer_client import PromptGroup

from helpers import collect, unique


def _group(**overrides) -> pb.PromptGroup:
    g = pb.PromptGroup(prompt_token_ids=[1, 7, 8], num_samples=2, sampling=pb.SamplingParams(max_tokens=16))
    for key, value in overrides.items():
        target, name = (g.sampling, key.split(".", 1)[1]) if key.startswith("sampling.") else (g, key)
        if isinstance(value, list):
            del getattr(target, name)[:]
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return g


BAD_SUBMITS = [
    ({"num_samples": 0}, "groups[0].num_samples"),
    ({"num_samples": 100000}, "groups[0].num_samples"),
    ({"sampling.max_tokens": 0}, "groups[0].sampling.max_tokens"),
    ({"sampling.temperature": -0.5}, "groups[0].sampling.temperature"),
    ({"sampling.temperature": float("nan")}, "groups[0].sampling.temperature"),
    ({"sampling.top_p": 0.0}, "groups[0].sampling.top_p"),
    ({"sampling.top_p": 1.5}, "groups[0].sampling.top_p"),
    ({"prompt_token_ids": []}, "groups[0].prompt_token_ids"),
    ({"prompt_token_ids": [1, 2, 10**6]}, "groups[0].prompt_token_ids[2]"),
    ({"sampling.top_k": 0}, "groups[0].sampling.top_k"),
    ({"sampling.min_tokens": 17}, "groups[0].sampling.min_tokens"),
    # Every list and string field has a limit (docs/api.md#limits).
    ({"sampling.stop_token_ids": [2] * 257}, "groups[0].sampling.stop_token_ids"),
    ({"sampling.seed": 2**63}, "groups[0].sampling.seed"),
    ({"prompt_token_ids": [1] * 4096}, "groups[0].prompt_token_ids"),
    ({"prompt_text": "x" * 1_000_001}, "groups[0].prompt_text"),
    ({"group_id": "g" * 257}, "groups[0].group_id"),
    ({"prompt_id": "p" * 257}, "groups[0].prompt_id"),
]


async def _valid_round_trip(client) -> None:
    gid = unique("after-bad")
    await client.submit([PromptGroup(prompt_token_ids=[1, 9], num_samples=2, max_tokens=16, group_id=gid)])
    assert len(await collect(client, gid, 2, timeout=20)) == 2


@pytest.mark.parametrize("overrides,field", BAD_SUBMITS, ids=[f for _, f in BAD_SUBMITS])
async def test_bad_submit_is_invalid_argument_naming_the_field(client, overrides, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client._stub.Submit(pb.SubmitRequest(groups=[_group(**overrides)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    await _valid_round_trip(client)


BAD_ABORTS = [
    (pb.AbortRequest(group_ids=["g"] * 4097), "group_ids"),
    (pb.AbortRequest(group_ids=["g" * 257]), "group_ids[0]"),
    (pb.AbortRequest(batch_id="b" * 257), "batch_id"),
]


@pytest.mark.parametrize("request_,field", BAD_ABORTS, ids=[f for _, f in BAD_ABORTS])
async def test_oversized_abort_and_continue_fields_are_invalid_argument_naming_them(client, request_, field):
    for call, message in ((client._stub.Abort, request_),
                          (client._stub.Continue, pb.ContinueRequest(sample_id="g/0", observation_token_ids=[1] * 4096)),
                          (client._stub.Continue, pb.ContinueRequest(sample_id="g/0", observation_text="x" * 10**6 + "x"))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(message)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        named = field if call is client._stub.Abort else (
            "observation_text" if message.observation_text else "observation_token_ids")
        assert err.value.details().startswith(named + " ")
    await _valid_round_trip(client)


async def test_min_tokens_up_to_max_tokens_is_served_at_that_length(client):
    gid = unique("min-tokens")
    await client.submit([PromptGroup(prompt_token_ids=[1, 9], num_samples=8, max_tokens=40, min_tokens=40, group_id=gid)])
    assert [len(s.response_token_ids) for s in await collect(client, gid, 8, timeout=20)] == [40] * 8


async def test_error_message_states_the_allowed_range(client):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client._stub.Submit(pb.SubmitRequest(groups=[_group(num_samples=0)]))
    assert err.value.details() == "groups[0].num_samples must be in [1, 1024], got 0"


async def test_a_bad_group_rejects_the_whole_submit_and_creates_nothing(client):
    good = _group(group_id=unique("good"))
    with pytest.raises(grpc.aio.AioRpcError):
        await client._stub.Submit(pb.SubmitRequest(groups=[good, _group(num_samples=0)]))
    # The good group of the rejected request was not created: submitting it now creates it.
    assert await client.submit_detailed([PromptGroup(prompt_token_ids=[1, 7], num_samples=1, max_tokens=4,
                                                     group_id=good.group_id)]) == [(good.group_id, True)]


async def test_abort_of_unknown_group_is_not_found(client):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.abort(["no-such-group"])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "group_ids" in err.value.details()
    await _valid_round_trip(client)


async def test_abort_with_no_selector_is_invalid_argument(client):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.abort()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stream_without_consumer_id_is_invalid_argument(client):
    call = client._stub.StreamSamples(pb.StreamSamplesRequest(consumer_id=""))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "consumer_id" in err.value.details()


async def test_oversized_message_is_resource_exhausted(client):
    huge = _group()
    huge.metadata["pad"] = "x" * (70 * 1024 * 1024)  # over the 64 MiB message limit
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client._stub.Submit(pb.SubmitRequest(groups=[huge]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await _valid_round_trip(client)


async def test_too_many_groups_in_one_submit_is_resource_exhausted(client):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client._stub.Submit(pb.SubmitRequest(groups=[_group()] * 5000))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "groups" in err.value.details()


def _header(version, arrays, **spec_overrides):
    specs = []
    for name, a in arrays.items():
        spec = pb.TensorSpec(name=name, dtype=str(a.dtype), shape=list(a.shape), byte_length=a.nbytes,
                             sha256=hashlib.sha256(a.tobytes()).hexdigest())
        for k, v in spec_overrides.items():
            setattr(spec, k, v)
        specs.append(spec)
    return pb.WeightsHeader(version=version, tensors=specs)


async def _push(client, header, payload: bytes):
    chunks = [pb.WeightsChunk(header=header)] + [pb.WeightsChunk(data=payload[i:i + 1000]) for i in range(0, len(payload), 1000)]
    return await client._stub.PushWeights(iter(chunks))


async def test_push_whose_bytes_do_not_match_the_manifest_is_rejected(client):
    before = (await client.status()).policy_version
    a = np.arange(1000, dtype=np.float32)
    header = _header(before + 1, {"w": a})
    cases = {
        "truncated": a.tobytes()[:-8],
        "too long": a.tobytes() + b"12345678",
        "corrupt": a.tobytes()[:-4] + b"\0\0\0\1",
    }
    for name, payload in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _push(client, header, payload)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert ("data" in err.value.details()) or ("sha256" in err.value.details()), name
    bad_len = _header(before + 1, {"w": a}, byte_length=123)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(client, bad_len, a.tobytes())
    assert "header.tensors[0].byte_length" in err.value.details()
    assert (await client.status()).policy_version == before
    await _valid_round_trip(client)


async def test_good_push_bumps_version_and_tags_new_tokens(client):
    before = (await client.status()).policy_version
    reply = await client.push_weights({"w": np.ones((64, 64), dtype=np.float32)}, version=before + 1)
    assert reply.applied_version == before + 1
    assert (await client.status()).policy_version == before + 1
    gid = unique("after-push")
    await client.submit([PromptGroup(prompt_token_ids=[1, 9], num_samples=2, max_tokens=16, group_id=gid)])
    for s in await collect(client, gid, 2):
        assert s.min_version == s.max_version == before + 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.push_weights({"w": np.ones(4, dtype=np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in err.value.details()


async def test_draft_push_without_speculation_names_the_target(client):
    before = (await client.status()).policy_version
    for target, why in (("draft", "do not speculate"), ("critic", "'policy' or 'draft'")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.push_weights({"w": np.ones(4, dtype=np.float32)}, version=before + 1, target=target)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.target" in err.value.details() and why in err.value.details()
    assert (await client.status()).policy_version == before
    await _valid_round_trip(client)


async def test_server_survives_a_burst_of_bad_requests(client):
    bad = [client._stub.Submit(pb.SubmitRequest(groups=[_group(**o)])) for o, _ in BAD_SUBMITS] * 5
    results = await asyncio.gather(*bad, return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in results)
    await _valid_round_trip(client)


async def test_many_prompt_texts_are_tokenised_off_the_event_loop():
    import threading

    from rollout_service.api import validation

    class Tokenizer:
        threads: set[int] = set()

        def encode(self, text: str) -> list[int]:
            self.threads.add(threading.get_ident())
            return [ord(c) % 50 for c in text]

        def decode(self, ids):
            return ""

    def request(n: int) -> pb.SubmitRequest:
        return pb.SubmitRequest(groups=[pb.PromptGroup(prompt_text=f"prompt {i}", num_samples=1,
                                                       sampling=pb.SamplingParams(max_tokens=4)) for i in range(n)])

    limits = validation.ModelLimits(vocab_size=64, max_model_len=128)
    tok = Tokenizer()
    specs = await validation.submit_request_off_loop(request(1000), limits, tok)
    assert len(specs) == 1000 and threading.get_ident() not in tok.threads
    assert [s.prompt_token_ids for s in specs[:2]] == [tok.encode("prompt 0"), tok.encode("prompt 1")]
    tok.threads.clear()
    await validation.submit_request_off_loop(request(2), limits, tok)  # a few: inline
    assert tok.threads == {threading.get_ident()}


async def test_stop_strings_are_checked_and_refused_on_simulated_engines(client):
    for stops, field in ((["</tool>"], "groups[0].sampling.stop"), ([""], "groups[0].sampling.stop[0]"),
                         (["x"] * 17, "groups[0].sampling.stop"), (["y" * 257], "groups[0].sampling.stop[0]")):
        g = _group()
        g.sampling.stop.extend(stops)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client._stub.Submit(pb.SubmitRequest(groups=[g]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
    await _valid_round_trip(client)
