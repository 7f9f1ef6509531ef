"""Random and oversized values sent to every RPC and every HTTP route of the
real server: every answer is a status that names what is wrong (never gRPC
UNKNOWN or INTERNAL, never HTTP 500, never a failure inside the service),
no message carries a traceback or a path of the server's machine, and a
normal rollout works afterwards."""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import aiohttp
import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rollout_service
from rollout_proto import rollout_pb2 as pb
from rollout_proto import rollout_pb2_grpc
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient

from helpers import collect, sim_config, unique

SERVICE = pb.DESCRIPTOR.services_by_name["RolloutService"]
INTS = {F.TYPE_INT32: 31, F.TYPE_SINT32: 31, F.TYPE_INT64: 63, F.TYPE_SINT64: 63, F.TYPE_UINT32: 32, F.TYPE_UINT64: 64}
# Text as a client might send it: short, unicode, control characters, and past every documented limit.
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["", "x" * 257, "é" * 70_000, "\x00", "../../x", "g/0",
                                                        "y" * 1_000_001, "float32", "policy", "draft", "xxh3_128"]))
LEAKS = ("Traceback", 'File "', str(Path(rollout_service.__file__).resolve().parents[1]), sys.prefix,
         tempfile.gettempdir() + "/", "failed inside the service")


def _scalar(draw, field):
    t = field.type
    if t in INTS:
        bits = INTS[t]
        lo, hi = (0, 2**bits - 1) if t in (F.TYPE_UINT32, F.TYPE_UINT64) else (-2**bits, 2**bits - 1)
        return draw(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, 1, 2, 100, 1024, 4097])))
    if t == F.TYPE_BOOL:
        return draw(st.booleans())
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return draw(st.floats(width=32 if t == F.TYPE_FLOAT else 64))
    if t == F.TYPE_STRING:
        return draw(TEXT)
    if t == F.TYPE_BYTES:
        return draw(st.binary(max_size=64))
    if t == F.TYPE_ENUM:
        return draw(st.sampled_from([v.number for v in field.enum_type.values]))
    raise AssertionError(field.full_name)


def message(draw, descriptor, depth: int = 0):
    """A message of `descriptor` with a random subset of its fields set to random values."""
    msg = pb.__dict__.get(descriptor.name)() if descriptor.name in pb.__dict__ else None
    if msg is None:  # a nested type
        from google.protobuf import message_factory
        msg = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if depth > 3 or not draw(st.booleans()):
            continue
        target = getattr(msg, field.name)
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                target[_scalar(draw, key_f)] = _scalar(draw, value_f)
        elif field.is_repeated:
            n = draw(st.sampled_from([0, 1, 2, 3, 300, 5000]))
            if field.type == F.TYPE_MESSAGE:
                for _ in range(min(n, 3)):
                    target.add().CopyFrom(message(draw, field.message_type, depth + 1))
            elif field.type in (F.TYPE_STRING, F.TYPE_BYTES):  # many strings, or a few long ones
                target.extend([_scalar(draw, field) for _ in range(min(n, 3))] if n < 300 else ["s"] * n)
            else:
                target.extend([_scalar(draw, field)] * n)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(message(draw, field.message_type, depth + 1))
        else:
            setattr(msg, field.name, _scalar(draw, field))
    return msg


def _assert_clean(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, text


@pytest.fixture(scope="module")
def fuzz_server():
    """A server on its own loop (hypothesis drives synchronous tests)."""
    loop = asyncio.new_event_loop()
    cfg = sim_config(num_engines=1)
    cfg.push_idle_timeout_s = 1.0
    service = RolloutService(cfg)
    loop.run_until_complete(service.start())

    async def open_clients():  # bound to this loop
        return grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}"), aiohttp.ClientSession()

    channel, session = loop.run_until_complete(open_clients())
    yield loop, rollout_pb2_grpc.RolloutServiceStub(channel), session, service

    async def normal_rollout():
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="after-fuzz") as c:
            gid = unique("after-fuzz")
            await c.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=4, max_tokens=16, group_id=gid)])
            assert len(await collect(c, gid, 4)) == 4

    loop.run_until_complete(normal_rollout())
    loop.run_until_complete(session.close())
    loop.run_until_complete(channel.close())
    loop.run_until_complete(service.stop())
    loop.close()


async def _call(stub, method, draw):
    """One call of `method` with random request(s); returns the status it ended with."""
    fn = getattr(stub, method.name)
    try:
        if method.client_streaming:  # PushWeights: a header, random chunks, the end of the stream
            chunks = [message(draw, method.input_type) for _ in range(draw(st.integers(1, 3)))]
            await asyncio.wait_for(fn(iter(chunks)), 15)
        elif method.server_streaming:  # read a little: a stream may rightly wait for samples
            call = fn(message(draw, method.input_type))
            try:
                # The request is validated before the stream's metadata is sent (an invalid one has
                # ended by then); what it has to send at once comes within half a second after.
                await asyncio.wait_for(call.initial_metadata(), 15)
                await asyncio.wait_for(call.read(), 0.5)
            except asyncio.TimeoutError:
                pass
            finally:
                call.cancel()
        else:
            await asyncio.wait_for(fn(message(draw, method.input_type)), 15)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_rpc_answers_random_and_oversized_values_with_a_status_naming_them(fuzz_server, data):
    loop, stub, _, _ = fuzz_server
    method = data.draw(st.sampled_from(list(SERVICE.methods)))
    code, details = loop.run_until_complete(_call(stub, method, data.draw))
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method.name, code, details)
    if code == grpc.StatusCode.CANCELLED:  # only a stream this test cancels itself
        assert method.server_streaming, (method.name, details)
    _assert_clean(details)


ROUTES = [("GET", p) for p in ("/healthz", "/health", "/readyz", "/metrics", "/v1/status", "/v1/models",
                                "/server_info", "/get_world_size", "/weight_info", "/is_paused", "/version")]
# Not /pause: a pause holds every later request of the run.
ROUTES += [("POST", p) for p in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate",
                                 "/reset_prefix_cache", "/init_weight_transfer_engine", "/update_weights",
                                 "/start_weight_update", "/finish_weight_update", "/update_weight_version",
                                 "/abort_requests")]
KEYS = ["model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "seed", "stream", "stream_options", "logprobs", "top_logprobs", "stop", "stop_token_ids", "min_tokens",
        "ignore_eos", "user", "return_token_ids", "return_tokens_as_token_ids", "include_stop_str_in_output",
        "tools", "tool_choice", "token_ids", "sampling_params", "request_id", "features", "min_p", "echo", "foo"]
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([10**400, -10**400, 0, 1, 2, 20, 2**62, 2**63]),
                    st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner,
                                                                                         max_size=4)), max_leaves=12)
BODY = st.one_of(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=8).map(lambda d: json.dumps(d).encode()),
                 st.fixed_dictionaries({"prompt": st.lists(st.integers(0, 99), min_size=1, max_size=8),
                                        "max_tokens": st.integers(1, 8)},
                                       optional={k: JSON for k in KEYS if k not in ("prompt", "max_tokens")}).map(lambda d: json.dumps(d).encode()),
                 st.binary(max_size=64), st.just(b"[" * 5000))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=BODY, query=st.dictionaries(st.sampled_from(["config_format", "x"]), TEXT,
                                                                       max_size=2))
def test_every_http_route_answers_random_and_oversized_values_without_a_500(fuzz_server, route, body, query):
    loop, _, session, service = fuzz_server
    method, path = route

    async def one():
        url = f"http://127.0.0.1:{service.http_port}{path}"
        params = {k: v[:1000] for k, v in query.items()}
        async with session.request(method, url, data=body if method == "POST" else None, params=params,
                                   headers={"Content-Type": "application/json"},
                                   timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.text()

    status, text = loop.run_until_complete(one())
    assert status < 500 or status == 501 or (path == "/readyz" and status == 503), (path, status, text[:300])
    _assert_clean(text)
