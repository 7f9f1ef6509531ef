"""A weight push that fails on an engine is reported as the engine's failure
(not as a bad request), and the previous version keeps serving."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from rollout_proto import rollout_pb2 as pb
from rollout_service.engines.weights import read_safetensors
from trainer_client import PromptGroup, RolloutClient
from trainer_client import weights as wire

from helpers import collect, connect, running, sim_config, unique, wait_until


@pytest.fixture(scope="module")
async def service(tmp_path_factory):
    """Its own service: these tests break its engines' weight updates. File
    pushes may read the tests' temporary directories."""
    cfg = sim_config(num_engines=2)
    cfg.weights_file_dirs = [str(tmp_path_factory.getbasetemp())]
    async with running(cfg) as service:
        yield service


@pytest.fixture
async def rclient(service):
    async with connect(service, "push-fail") as c:
        yield c


def _break_updates(monkeypatch, engine, exc: BaseException, delay_s: float = 0.05) -> None:
    async def update_weights(version, weights):
        await asyncio.sleep(delay_s)  # as `asyncio.wait_for` does, past its timeout
        raise exc

    monkeypatch.setattr(engine, "update_weights", update_weights)


async def _still_serves(client: RolloutClient, version: int) -> None:
    assert (await client.status()).policy_version == version
    gid = unique("after-failed-push")
    await client.submit([PromptGroup(prompt_token_ids=[1, 4], num_samples=2, max_tokens=16, group_id=gid)])
    samples = await collect(client, gid, 2)
    assert all(s.min_version == s.max_version == version for s in samples)


async def test_engine_update_timeout_is_deadline_exceeded_naming_the_engine(service, rclient, monkeypatch):
    engines = list(service.core.engines.values())
    for engine in engines:  # all of them, so that no engine moves on alone
        _break_updates(monkeypatch, engine, TimeoutError())  # what a stuck vLLM engine raises
    before = (await rclient.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert all(e.engine_id in err.value.details() for e in engines), err.value.details()
    assert "file_path" not in err.value.details()
    await _still_serves(rclient, before)


async def test_engine_connection_failure_is_unavailable_naming_the_engine(service, rclient, monkeypatch):
    engines = list(service.core.engines.values())
    for engine in engines:
        _break_updates(monkeypatch, engine, ConnectionResetError(104, "Connection reset by peer"))
    before = (await rclient.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert all(e.engine_id in err.value.details() for e in engines), err.value.details()
    assert "file_path" not in err.value.details()
    await _still_serves(rclient, before)


async def test_missing_weights_file_is_invalid_argument_naming_the_path(rclient, tmp_path):
    before = (await rclient.status()).policy_version
    for path in (tmp_path / "absent.safetensors", tmp_path):  # missing; a directory
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient.push_weights_file(str(path), version=before + 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.file_path" in err.value.details() and str(path) in err.value.details()
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights_file(str(tmp_path / "junk.safetensors"), version=before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.file_path" in err.value.details()
    assert (await rclient.status()).policy_version == before


async def test_push_after_a_failed_one_applies(service, rclient):
    before = (await rclient.status()).policy_version
    reply = await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert reply.applied_version == before + 1
    await _still_serves(rclient, before + 1)


# -- checksums: the algorithm choice, verified while receiving ---------------------------



def _state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """Several tensors (one empty, one tiny) so that chunks span tensors."""
    rng = np.random.default_rng(seed)
    return {"a": rng.random((64, 33), dtype=np.float32), "empty": np.zeros((0, 4), np.float32),
            "b": rng.random(7, dtype=np.float32), "c": rng.integers(0, 9, (50, 50)).astype(np.int64)}


def _staged_matches(service, sd) -> None:
    """The live version's staging file holds exactly the pushed bytes."""
    specs, buffer = read_safetensors(service.core.weight_sync.last.path)
    assert [s.name for s in specs] == list(sd)
    offset = 0
    for s in specs:
        assert bytes(buffer[offset:offset + s.byte_length]) == sd[s.name].tobytes(), s.name
        offset += s.byte_length


@pytest.mark.parametrize("trailer", [True, False], ids=["digests-in-trailer", "digests-in-header"])
@pytest.mark.parametrize("checksums", ["xxh3", "xxh3_64", "sha256", False, True])
async def test_push_with_each_checksum_choice_applies(service, rclient, checksums, trailer):
    before = (await rclient.status()).policy_version
    sd = _state_dict(before)
    # 1000-byte chunks: chunks end inside tensors and span several.
    reply = await rclient.push_weights(sd, version=before + 1, checksums=checksums, chunk_mb=1000 / 2**20,
                                       checksum_trailer=trailer)
    assert reply.applied_version == before + 1
    assert reply.bytes_received == sum(a.nbytes for a in sd.values())
    _staged_matches(service, sd)
    await _still_serves(rclient, before + 1)


async def _corrupt_push(client: RolloutClient, sd, version: int, checksums: str, chunk_index: int,
                        chunk_bytes: int = 4096):
    """A push whose chunk `chunk_index` (after the header) has one byte flipped."""
    tensors = wire.flatten(sd)
    algo = wire.checksum_algo(checksums)
    header = pb.WeightsHeader(version=version, tensors=wire.manifest(tensors, checksums),
                              checksum_algo="" if algo == "sha256" else algo)

    def chunks():
        for i, chunk in enumerate(wire.chunks(header, tensors, chunk_bytes)):
            if i == chunk_index:
                data = bytearray(b"".join(chunk))
                data[len(data) // 2] ^= 0x01
                chunk = [data]
            yield chunk

    return await client._push(chunks())


@pytest.mark.parametrize("checksums,field", [("xxh3", "digest"), ("xxh3_64", "digest"), ("sha256", "sha256")])
async def test_corrupted_chunk_is_invalid_argument_naming_the_tensor(service, rclient, checksums, field):
    before = (await rclient.status()).policy_version
    sd = _state_dict()  # "a" is 8448 bytes: chunks 1-3 (4096 bytes each) hold a, empty, b, c
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _corrupt_push(rclient, sd, before + 1, checksums, chunk_index=3)  # bytes 8192.. : "c"
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert f"header.tensors[3].{field}" in err.value.details() and "'c'" in err.value.details(), err.value.details()
    await _still_serves(rclient, before)


def _trailer_push(sd, version: int, algo: str, digests=None, flip_chunk: int | None = None):
    """The messages of a push whose digests follow the data: `digests`
    replaces the true ones; chunk `flip_chunk` has one byte flipped."""
    tensors = wire.flatten(sd)
    header = pb.WeightsHeader(version=version, tensors=wire.manifest(tensors, False), checksum_algo=algo)
    msgs = list(wire.chunks(header, tensors, 4096))
    if flip_chunk is not None:
        data = bytearray(b"".join(msgs[flip_chunk]))
        data[len(data) // 2] ^= 0x01
        msgs[flip_chunk] = [data]
    true = wire.digests(tensors, algo)
    return msgs, pb.WeightsChunk(trailer=pb.WeightsTrailer(digests=true if digests is None else digests(true)))


@pytest.mark.parametrize("algo", ["xxh3_128", "xxh3_64", "sha256"])
async def test_trailer_digest_mismatch_is_invalid_argument_naming_the_tensor(service, rclient, algo):
    before = (await rclient.status()).policy_version
    sd = _state_dict()  # "a" is 8448 bytes: chunks 1-3 (4096 bytes each) hold a, empty, b, c
    msgs, trailer = _trailer_push(sd, before + 1, algo, flip_chunk=3)  # bytes 8192.. : "c"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient._push(iter(msgs + [trailer]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "trailer.digests[3]" in err.value.details() and "'c'" in err.value.details(), err.value.details()
    # Intact bytes, a wrong digest for "b".
    msgs, trailer = _trailer_push(sd, before + 1, algo, digests=lambda d: d[:2] + ["0" * len(d[2])] + d[3:])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient._push(iter(msgs + [trailer]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "trailer.digests[2]" in err.value.details() and "'b'" in err.value.details(), err.value.details()
    await _still_serves(rclient, before)


async def test_a_misplaced_missing_or_short_trailer_is_invalid_argument(service, rclient):
    before = (await rclient.status()).policy_version
    msgs, trailer = _trailer_push(_state_dict(), before + 1, "xxh3_128")
    cases = {
        "missing": (msgs, "without the WeightsTrailer"),
        # Data still streamed after the early trailer: the service drains it and refuses.
        "before the end of the data": (msgs[:2] + [trailer] + msgs[2:], "follows all the data"),
        "followed by data": (msgs + [trailer, [memoryview(b"x")]], "last message"),
        "twice": (msgs + [trailer, trailer], "last message"),
        "short": (msgs + [pb.WeightsChunk(trailer=pb.WeightsTrailer(digests=trailer.trailer.digests[:3]))],
                  "3 digests for the manifest's 4 tensors"),
        "bad hex": (msgs + [pb.WeightsChunk(trailer=pb.WeightsTrailer(digests=["XY"] * 4))], "trailer.digests[0]"),
    }
    for case, (stream, message) in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient._push(iter(stream))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.value.details())
        assert "trailer" in err.value.details() and message in err.value.details(), (case, err.value.details())
    # Digests in the header and a trailer as well: the trailer is refused.
    tensors = wire.flatten(_state_dict())
    header = pb.WeightsHeader(version=before + 1, tensors=wire.manifest(tensors, "xxh3"), checksum_algo="xxh3_128")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient._push(iter(list(wire.chunks(header, tensors, 4096)) + [trailer]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "trailer" in err.value.details()
    await _still_serves(rclient, before)


async def test_old_style_header_with_sha256_only_still_applies(service, rclient):
    """What clients before checksum_algo send: protobuf-serialized chunks,
    TensorSpec.sha256 and no algorithm."""
    import hashlib

    before = (await rclient.status()).policy_version
    a = np.arange(3000, dtype=np.float32)
    spec = pb.TensorSpec(name="w", dtype="float32", shape=[3000], byte_length=a.nbytes,
                         sha256=hashlib.sha256(a.tobytes()).hexdigest())
    header = pb.WeightsHeader(version=before + 1, tensors=[spec])
    raw = a.tobytes()
    msgs = [pb.WeightsChunk(header=header)] + [pb.WeightsChunk(data=raw[i:i + 5000]) for i in range(0, len(raw), 5000)]
    reply = await rclient._stub.PushWeights(iter(msgs))
    assert reply.applied_version == before + 1
    _staged_matches(service, {"w": a})
    bad = bytearray(raw)
    bad[100] ^= 0xFF
    header.version = before + 2
    msgs = [pb.WeightsChunk(header=header), pb.WeightsChunk(data=bytes(bad))]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient._stub.PushWeights(iter(msgs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.tensors[0].sha256" in err.value.details() and "'w'" in err.value.details()
    await _still_serves(rclient, before + 1)


@pytest.mark.parametrize("algo", ["xxh3_64", "xxh3_128"])
async def test_digests_as_python_xxhash_computes_them_verify(service, rclient, algo):
    """Senders hash with any xxHash binding (here python-xxhash), in the header or the trailer."""
    import xxhash

    before = (await rclient.status()).policy_version
    a = np.random.default_rng(5).random(5000, dtype=np.float32)
    digest = getattr(xxhash, algo)(a.tobytes()).hexdigest()
    spec = pb.TensorSpec(name="w", dtype="float32", shape=[5000], byte_length=a.nbytes)
    for version, in_header in ((before + 1, True), (before + 2, False)):
        if in_header:
            spec.digest = digest
        else:
            spec.ClearField("digest")
        header = pb.WeightsHeader(version=version, tensors=[spec], checksum_algo=algo)
        msgs = [pb.WeightsChunk(header=header), pb.WeightsChunk(data=a.tobytes())]
        if not in_header:
            msgs.append(pb.WeightsChunk(trailer=pb.WeightsTrailer(digests=[digest])))
        reply = await rclient._stub.PushWeights(iter(msgs))
        assert reply.applied_version == version
    _staged_matches(service, {"w": a})
    await _still_serves(rclient, before + 2)


async def test_unknown_checksum_algo_or_bad_digest_is_invalid_argument_naming_the_field(service, rclient):
    before = (await rclient.status()).policy_version
    a = np.ones(16, np.float32)
    cases = [("md5", "ab" * 16, "header.checksum_algo"), ("xxh3_64", "ab" * 16, "header.tensors[0].digest"),
             ("xxh3_128", "XY" * 16, "header.tensors[0].digest")]
    for algo, digest, field in cases:
        spec = pb.TensorSpec(name="w", dtype="float32", shape=[16], byte_length=a.nbytes, digest=digest)
        header = pb.WeightsHeader(version=before + 1, tensors=[spec], checksum_algo=algo)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient._stub.PushWeights(iter([pb.WeightsChunk(header=header), pb.WeightsChunk(data=a.tobytes())]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, algo
        assert field in err.value.details(), (algo, err.value.details())
    with pytest.raises(ValueError, match="checksums"):
        await rclient.push_weights({"w": a}, version=before + 1, checksums="md5")
    await _still_serves(rclient, before)


def test_chunks_are_views_that_cover_the_tensors_once():
    sd = _state_dict()
    tensors = wire.flatten(sd)
    header = pb.WeightsHeader(version=1, tensors=wire.manifest(tensors, False))
    it = wire.chunks(header, tensors, 4096)
    assert isinstance(next(it), pb.WeightsChunk)
    chunks = list(it)
    assert all(isinstance(p, memoryview) for c in chunks for p in c)
    assert [sum(len(p) for p in c) for c in chunks[:-1]] == [4096] * (len(chunks) - 1)
    assert b"".join(b"".join(c) for c in chunks) == b"".join(a.tobytes() for a in sd.values())
    # The serialized message is a WeightsChunk protobuf reads back.
    assert pb.WeightsChunk.FromString(wire.serialize_chunk(chunks[0])).data == b"".join(chunks[0])


def test_parse_chunk_reads_data_messages_without_protobuf_and_the_rest_with_it():
    from rollout_service.api.weights_receiver import parse_chunk

    for n in (0, 1, 127, 128, 16383, 16384, 300_000):
        data = bytes(range(256)) * (n // 256) + bytes(n % 256)
        got = parse_chunk(pb.WeightsChunk(data=data).SerializeToString())
        got = got if isinstance(got, memoryview) else memoryview(got.data)
        assert bytes(got) == data, n
    header = pb.WeightsChunk(header=pb.WeightsHeader(version=3, checksum_algo="xxh3_64"))
    assert parse_chunk(header.SerializeToString()).header.version == 3
    twice = pb.WeightsChunk(data=b"abc").SerializeToString() + pb.WeightsChunk(data=b"defg").SerializeToString()
    assert parse_chunk(twice).data == b"defg"  # protobuf's rule (last one wins), not a view of the first


async def test_a_refused_or_abandoned_push_leaves_no_staging_file(service, rclient, monkeypatch):
    import os

    from rollout_service.api import weights_receiver

    paths = []

    class Recording(weights_receiver.StagingWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            paths.append(self.path)

    monkeypatch.setattr(weights_receiver, "StagingWriter", Recording)
    before = (await rclient.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError):
        await _corrupt_push(rclient, _state_dict(), before + 1, "xxh3", chunk_index=1)
    # A stream that stops half-way through (the sender goes away).
    tensors = wire.flatten(_state_dict())
    header = pb.WeightsHeader(version=before + 1, tensors=wire.manifest(tensors, "xxh3"), checksum_algo="xxh3_128")

    def half():
        for i, chunk in enumerate(wire.chunks(header, tensors, 4096)):
            if i == 2:
                raise RuntimeError("trainer died")
            yield chunk

    with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):  # grpc cancels the call
        await rclient._push(half())
    # The service learns of the cancelled stream asynchronously (and may
    # not have read the header by then: then it made no file).
    assert paths
    await wait_until(lambda: not any(os.path.exists(p) for p in paths), 2.5, f"the push's files {paths} removed")
    await _still_serves(rclient, before)


# -- pushes that meet, and a trainer that stalls ----------------------------------------


async def test_pushes_that_meet_are_applied_one_at_a_time_or_refused_naming_the_version(service, rclient, monkeypatch):
    loop = asyncio.get_running_loop()
    applying = asyncio.Event()  # set when an engine starts applying
    applies: dict[str, list[tuple[int, float, float]]] = {}  # engine -> (version, start, end)
    for engine in service.core.engines.values():
        async def slow(version, weights, apply=engine.update_weights, eid=engine.engine_id):
            t0 = loop.time()
            applying.set()
            await asyncio.sleep(0.3)  # an apply that takes a while
            await apply(version, weights)
            applies.setdefault(eid, []).append((version, t0, loop.time()))

        monkeypatch.setattr(engine, "update_weights", slow)

    async def push(version: int, while_applying: bool = False):
        if while_applying:
            await applying.wait()
        return await rclient.push_weights({"w": np.full(64, version, np.float32)}, version=version)

    v = (await rclient.status()).policy_version
    # A newer push arriving while one applies waits for it, then applies.
    applying.clear()
    first, second = await asyncio.gather(push(v + 1), push(v + 2, while_applying=True))
    assert (first.applied_version, second.applied_version) == (v + 1, v + 2)
    for eid, runs in applies.items():
        assert [r[0] for r in runs] == [v + 1, v + 2], eid
        assert runs[0][2] <= runs[1][1], (eid, runs)  # one at a time
    # An older one (or the same version twice) is refused once the other has applied.
    for versions in ((v + 4, v + 3), (v + 5, v + 5)):
        applying.clear()
        results = await asyncio.gather(push(versions[0]), push(versions[1], while_applying=True),
                                       return_exceptions=True)
        assert results[0].applied_version == versions[0], results
        assert isinstance(results[1], grpc.aio.AioRpcError), results
        assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"greater than the serving version {versions[0]}" in results[1].details(), results[1].details()
    await _still_serves(rclient, v + 5)


async def test_a_trainer_that_stalls_before_the_trailer_leaves_the_previous_version(service, rclient, monkeypatch):
    monkeypatch.setattr(service._servicer.weights, "push_idle_timeout_s", 0.5)
    before = (await rclient.status()).policy_version
    msgs, _ = _trailer_push(_state_dict(), before + 1, "xxh3_128")

    async def stalled():
        for m in msgs:  # all the data, then nothing
            yield m
        await asyncio.sleep(30)  # the trainer stalls: the service's idle timeout ends the push long before

    t0 = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient._push(stalled())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert asyncio.get_running_loop().time() - t0 < 10
    await _still_serves(rclient, before)


async def _versions_after(client: RolloutClient, service, version: int) -> None:
    """Every engine serves `version`, and new samples on each carry it."""
    await wait_until(lambda: all(e.load().state == "ready" and e.load().policy_version == version
                                 for e in service.core.engines.values()), 30, f"every engine on version {version}")
    gid = unique("one-version")
    await client.submit([PromptGroup(prompt_token_ids=[1, 4], num_samples=8, max_tokens=16, group_id=gid)])
    samples = await collect(client, gid, 8)
    assert all(s.min_version == s.max_version == version for s in samples), \
        [(s.engines, s.min_version, s.max_version) for s in samples]


async def test_a_push_that_fails_on_one_engine_changes_no_engine_s_version(service, rclient, monkeypatch):
    """The engines that applied it go back to the serving weights."""
    before = (await rclient.status()).policy_version
    if before == 0:
        before = (await rclient.push_weights({"w": np.ones(8, np.float32)}, version=1)).applied_version
    _break_updates(monkeypatch, service.core.engines["sim-1"], ConnectionResetError(104, "Connection reset by peer"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "sim-1" in err.value.details(), err.value.details()
    assert f"still serving version {before}" in err.value.details()
    await _versions_after(rclient, service, before)


async def test_an_engine_that_applied_a_failed_first_push_restarts_on_the_model_s_weights(monkeypatch):
    """Version 0 (the model's own weights) is not staged: that engine restarts."""
    async with running(sim_config(num_engines=2)) as fresh, connect(fresh, "first-push") as client:
        _break_updates(monkeypatch, fresh.core.engines["sim-1"], ConnectionResetError(104, "Connection reset by peer"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.push_weights({"w": np.ones(8, np.float32)}, version=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        await _versions_after(client, fresh, 0)
        assert (await client.status()).counters["engine_restarts"] >= 1


async def test_a_big_push_refused_at_its_header_gets_the_refusal_s_status(service, rclient):
    """The client streams the data only once the service has accepted the
    header: the refusal is not lost to a write failing on an ended call."""
    before = (await rclient.status()).policy_version
    sd = {"w": np.zeros(16 << 20, np.float32)}  # 64 MiB
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient.push_weights(sd, version=before)  # not newer than the serving one
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert f"greater than the serving version {before}" in err.value.details()
    await _still_serves(rclient, before)


async def test_a_push_refused_in_the_middle_of_its_data_gets_the_refusal_s_status(service, rclient):
    """A bad tensor early in a big push is refused while the sender is still
    streaming: the sender gets that status, not a failed write's INTERNAL."""
    before = (await rclient.status()).policy_version
    sd = {"w": np.zeros(1 << 20, np.float32), "v": np.ones(16 << 20, np.float32)}  # 4 + 64 MiB
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as err:  # chunk 1: the first MiB of "w"
            await _corrupt_push(rclient, sd, before + 1, "xxh3", chunk_index=1, chunk_bytes=1 << 20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
        assert "header.tensors[0]" in err.value.details() and "'w'" in err.value.details(), err.value.details()
    await _still_serves(rclient, before)
