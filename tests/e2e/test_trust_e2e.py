"""Trust boundaries on the real mesh: every internal port refuses plaintext, a missing client
certificate and another CA's certificate at the handshake; each method answers only the roles
that may call it (a printed method × caller table); forged billing spans bill nothing and do not
take a real request's ledger key; a worker runs requests only for routers."""
from __future__ import annotations

import os
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from llmmesh import billing, certs, mtls, queue
from llmmesh.identity import Role, allowed_roles
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat, ledger_rows, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]

INTERNAL = {"router": Role.ROUTER, "worker0": Role.WORKER, "costd": Role.COSTD}
PROBES_PER_KIND = 20


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> MeshIdentity:
    """A router certificate from a CA the mesh has never seen."""
    directory = tmp_path_factory.mktemp("stranger-ca")
    certs.ensure(directory, roles=[Role.ROUTER])
    return MeshIdentity(directory, Role.ROUTER)


def _stranger_channel(address: str, stranger: MeshIdentity, server_role: Role, mesh) -> grpc.Channel:
    # Trusts the mesh's CA (so the server is verified) but presents the stranger's certificate.
    ca = mesh.identity().ca_path.read_bytes()
    _, key, cert = stranger.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, creds, mtls.channel_options(server_role))


def _no_cert_channel(address: str, server_role: Role, mesh) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=mesh.identity().ca_path.read_bytes())
    return grpc.secure_channel(address, creds, mtls.channel_options(server_role))


def _health(channel: grpc.Channel) -> str:
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    except grpc.RpcError as exc:
        return exc.code().name


def test_every_internal_port_refuses_plaintext_no_cert_and_another_ca(mesh, stranger):
    kinds = {
        "plaintext": lambda a, r: grpc.insecure_channel(a),
        "no client cert": lambda a, r: _no_cert_channel(a, r, mesh),
        "other CA": lambda a, r: _stranger_channel(a, stranger, r, mesh),
    }
    print()
    for name, role in INTERNAL.items():
        address = mesh.procs[name].address
        refused = {}
        for kind, make in kinds.items():
            outcomes = []
            for _ in range(PROBES_PER_KIND):
                with make(address, role) as channel:   # a fresh handshake each time
                    outcomes.append(_health(channel))
            refused[kind] = sum(o == "UNAVAILABLE" for o in outcomes)
        with mtls.channel(address, mesh.identity(), role) as channel:
            admitted = _health(channel)
        print(f"  {name:8} {address}: " + ", ".join(
            f"{kind} refused {n}/{PROBES_PER_KIND}" for kind, n in refused.items()) +
            f"; mesh admin: {admitted}")
        assert refused == {kind: PROBES_PER_KIND for kind in kinds}, name
        assert admitted == "SERVING", name


def _methods(address: str, mesh, role: Role | None) -> list[tuple[str, bool]]:
    """(full method name, server-streaming) of every service the port lists through reflection
    (role None: the gateway's public port, plaintext on loopback)."""
    from google.protobuf import descriptor_pb2
    with (mtls.channel(address, mesh.identity(), role) if role else grpc.insecure_channel(address)) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = [s.name for s in reply.list_services_response.service]
        methods = []
        for service in names:
            if "reflection" in service:
                continue
            ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
            files = next(stub.ServerReflectionInfo(iter([ask]))).file_descriptor_response
            for raw in files.file_descriptor_proto:
                fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
                for svc in fd.service:
                    if f"{fd.package}.{svc.name}" == service:
                        methods += [(f"/{service}/{m.name}", m.server_streaming) for m in svc.method]
    return methods


def _call(channel: grpc.Channel, method: str, streaming: bool) -> str:
    try:
        if streaming:
            for _ in channel.unary_stream(method)(b"", timeout=3):
                break
        else:
            channel.unary_unary(method)(b"", timeout=3)
        return "answered"
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or ""):
            return "handshake refused"
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
            return f"broken: {code.name}"   # past the role check, but the method itself failed
        return "denied" if code == grpc.StatusCode.PERMISSION_DENIED else "answered"


def test_each_method_answers_only_the_roles_that_may_call_it(mesh, stranger):
    callers = {"no credentials": None, "other CA": "stranger", **{r.value: r for r in Role}}
    rows = []
    for name, server_role in INTERNAL.items():
        address = mesh.procs[name].address
        for method, streaming in _methods(address, mesh, server_role):
            if "WorkerService/Generate" in method:
                continue   # an empty request would run nothing; covered by the worker test below
            row = {}
            for label, who in callers.items():
                if who is None:
                    channel = grpc.insecure_channel(address)
                elif who == "stranger":
                    channel = _stranger_channel(address, stranger, server_role, mesh)
                else:
                    channel = mtls.channel(address, MeshIdentity.from_env(who), server_role)
                with channel:
                    row[label] = _call(channel, method, streaming)
            rows.append((f"{name:7} {method}", row))
    width = max(len(m) for m, _ in rows)
    print("\n  " + "method".ljust(width) + " | " + " | ".join(callers))
    for method, row in rows:
        print("  " + method.ljust(width) + " | " + " | ".join(row[c][:8].ljust(len(c)) for c in callers))
    for method, row in rows:
        assert row["no credentials"] == row["other CA"] == "handshake refused", method
        for role in Role:
            expected = "answered" if role in allowed_roles(method.split()[-1]) else "denied"
            assert row[role.value] == expected, (method, role)
    assert any("CostService/GetUsage" in m for m, _ in rows)


def test_the_public_port_answers_health_to_anyone_and_its_api_only_to_a_tenant(mesh):
    """S8 at the door: every method the gateway lists (reflection), called with no API key and
    with a tenant's: without a key only health and reflection answer; with one, every
    GatewayService method gets past authentication (an empty request is then refused for its
    content, not for who sent it)."""
    address = mesh.procs["gateway"].address
    rows = []
    for method, streaming in _methods(address, mesh, None):
        row = {}
        for label, md in (("no key", ()), ("tenant key", auth(DEMO_KEYS["acme"]))):
            with grpc.insecure_channel(address) as channel:
                try:
                    call = channel.unary_stream(method) if streaming else channel.unary_unary(method)
                    reply = call(b"", metadata=md, timeout=3)
                    if streaming:
                        next(iter(reply), None)
                    row[label] = "OK"
                except grpc.RpcError as exc:
                    row[label] = exc.code().name
        rows.append((method, row))
    print()
    for method, row in rows:
        print(f"  gateway {method:48} | no key: {row['no key']:17} | tenant key: {row['tenant key']}")
    api = [(m, r) for m, r in rows if m.startswith("/llmmesh.v1.GatewayService/")]
    assert len(api) >= 7
    for method, row in rows:
        if method.startswith("/llmmesh.v1.GatewayService/"):
            assert row["no key"] == "UNAUTHENTICATED", method
            assert row["tenant key"] not in ("UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL",
                                             "UNKNOWN"), (method, row)
        else:   # health and reflection: for probes and tools, no tenant needed
            assert row["no key"] == row["tenant key"] == "OK", (method, row)


def _forged_bill(request_id: str) -> trace_service_pb2.ExportTraceServiceRequest:
    now = time.time_ns()
    attrs = {"llmmesh.usage.final": True, "llmmesh.request.id": request_id,
             "llmmesh.tenant.id": "globex", "gen_ai.request.model": "smollm2-135m-instruct",
             "gen_ai.usage.input_tokens": 9_000_000, "gen_ai.usage.output_tokens": 9_000_000}
    span = trace_pb2.Span(trace_id=uuid.uuid4().bytes, span_id=b"\x01" * 8, name="router dispatch",
                          start_time_unix_nano=now - 10**9, end_time_unix_nano=now,
                          attributes=[KeyValue(key=k, value=billing.any_value(v))
                                      for k, v in attrs.items()])
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[{"scope_spans": [{"spans": [span]}]}])


def _ledger_rows(mesh, request_id: str) -> list[tuple]:
    return ledger_rows(mesh, request_id, "tenant_id, prompt_tokens, completion_tokens")


def test_forged_bills_bill_nothing_and_the_real_request_is_billed_once(mesh, gateway, stranger):
    request_id = f"forged-{uuid.uuid4().hex[:8]}"
    address = mesh.procs["costd"].address
    outcomes = {}
    for label in ("no cert", "other CA", "worker", "gateway", "admin"):
        if label == "no cert":
            channel = _no_cert_channel(address, Role.COSTD, mesh)
        elif label == "other CA":
            channel = _stranger_channel(address, stranger, Role.COSTD, mesh)
        else:
            channel = mtls.channel(address, MeshIdentity.from_env(Role(label)), Role.COSTD)
        with channel:
            try:
                reply = trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    _forged_bill(request_id), timeout=5)
                outcomes[label] = f"rejected {reply.partial_success.rejected_spans}"
            except grpc.RpcError as exc:
                outcomes[label] = exc.code().name
    print(f"\n  forged bills for globex: {outcomes}")
    assert outcomes == {"no cert": "UNAVAILABLE", "other CA": "UNAVAILABLE", "worker": "rejected 1",
                        "gateway": "rejected 1", "admin": "PERMISSION_DENIED"}
    assert "billing spans are accepted only from router identities" in open(
        f"{mesh.log_dir}/costd.log").read()
    assert _ledger_rows(mesh, request_id) == []
    # The real request under the same id is billed once, with its real tokens, to its tenant.
    req = chat("Say hi.", 4)
    req.request_id = request_id
    done = gateway.Complete(gateway_pb2.CompleteRequest(request=req), metadata=auth(DEMO_KEYS["globex"]),
                            timeout=120)
    u = done.final.usage
    rows = wait_until(lambda: _ledger_rows(mesh, request_id), 20, what="the real request's bill")
    assert rows == [("globex", u.prompt_tokens, u.completion_tokens)]


def test_a_worker_runs_requests_only_for_routers(mesh):
    address = mesh.procs["worker0"].address
    request_id = f"direct-{uuid.uuid4().hex[:8]}"
    request = worker_pb2.WorkerGenerateRequest(
        request_id=request_id, result_stream=queue.result_stream(request_id), tenant_id="globex", model="smollm2-135m-instruct",
        prompt_token_ids=[1, 2, 3, 4], sampling=common_pb2.SamplingParams(max_tokens=2),
        cache_salt="scope:globex", num_original_prompt_tokens=4,
        request_class=common_pb2.REQUEST_CLASS_INTERACTIVE)
    results = {}
    for role in Role:
        with mtls.channel(address, MeshIdentity.from_env(role), Role.WORKER) as channel:
            try:
                replies = list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(request, timeout=30))
                results[role.value] = f"ran ({len(replies)} messages)"
            except grpc.RpcError as exc:
                results[role.value] = exc.code().name
    print(f"\n  WorkerService.Generate by role: {results}")
    assert results.pop("router").startswith("ran")
    assert set(results.values()) == {"PERMISSION_DENIED"}


def test_request_ids_are_scoped_by_tenant_and_a_reused_id_is_billed_again(mesh, gateway):
    import redis as redis_client
    from concurrent.futures import ThreadPoolExecutor
    request_id = f"shared-{uuid.uuid4().hex[:8]}"

    def complete(tenant: str, max_tokens: int):
        req = chat("Count from one to ten.", max_tokens)
        req.request_id = request_id
        return gateway.Complete(gateway_pb2.CompleteRequest(request=req),
                                metadata=auth(DEMO_KEYS[tenant]), timeout=120)

    # The same id from two tenants at once: neither is refused, each gets its own completion.
    with ThreadPoolExecutor(2) as pool:
        acme, globex = pool.map(lambda a: complete(*a), [("acme", 3), ("globex", 7)])
    assert (acme.final.request_id, globex.final.request_id) == (request_id, request_id)
    assert (len(acme.token_ids), len(globex.token_ids)) == (3, 7)
    # The claim expires (shortened here by deleting it); the same id again is a new request.
    redis_client.Redis.from_url(mesh.redis_url).delete(queue.claim_key("acme", request_id))
    again = complete("acme", 5)
    assert len(again.token_ids) == 5

    def billed():
        rows = sorted(_ledger_rows(mesh, request_id))
        return rows if len(rows) == 3 else None
    rows = wait_until(billed, 20, what="three bills")
    assert rows == sorted([("acme", acme.final.usage.prompt_tokens, 3),
                           ("acme", again.final.usage.prompt_tokens, 5),
                           ("globex", globex.final.usage.prompt_tokens, 7)])


def test_canary_key_and_prompt_appear_nowhere_after_the_requests_end(mesh, gateway, span_capture):
    """S9: an API key and a prompt's text, run through the mesh, are found in no log, exported
    span, ledger, Redis key or value, or dead letter once the requests have ended."""
    import redis as redis_client
    canary = f"zebra{uuid.uuid4().hex[:10]}canary"
    key = DEMO_KEYS["globex"]
    for text in (f"Repeat after me: {canary}", f"Spell {canary} backwards."):
        gateway.Complete(gateway_pb2.CompleteRequest(request=chat(text, 4)), metadata=auth(key), timeout=120)
    time.sleep(1.0)                                   # spans and bills flushed
    found = []
    for name in os.listdir(mesh.log_dir):
        body = open(os.path.join(mesh.log_dir, name), errors="replace").read()
        found += [f"log {name}" for needle in (canary, key) if needle in body]
    spans = repr(span_capture.spans)
    found += [f"spans: {needle[:8]}" for needle in (canary, key) if needle in spans]
    ledger = open(f"{mesh.var_dir}/ledger.sqlite", "rb").read()
    found += [f"ledger: {n[:8]}" for n in (canary, key) if n.encode() in ledger]
    r = redis_client.Redis.from_url(mesh.redis_url)
    r.set("test:canary-control", canary, ex=60)       # the search must find this one
    for k in r.scan_iter(count=1000):
        kind = r.type(k).decode()
        value = (repr(r.xrange(k)) if kind == "stream" else repr(r.hgetall(k)) if kind == "hash"
                 else repr(r.smembers(k)) if kind == "set" else repr(r.get(k)) if kind == "string"
                 else "")
        found += [f"redis {k!r}" for n in (canary, key) if n in value or n in k.decode()]
    r.delete("test:canary-control")
    assert "redis b'test:canary-control'" in found, "the search itself is broken"
    found.remove("redis b'test:canary-control'")
    print(f"\n  canary and API key found in: {found or 'nothing'}")
    assert found == []


def _refused_events(mesh) -> float:
    import urllib.request
    body = urllib.request.urlopen(f"http://{mesh.procs['gateway'].metrics_address}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines()
               if line.startswith("llmmesh_result_events_refused_total"))


def test_a_writer_that_is_not_the_current_attempt_gets_no_token_to_the_client(mesh, gateway):
    """Stream injection: someone holding Redis's password (a stranger, or a worker this request
    was never given to) writes the next chunk of a live request's result stream before its
    worker does, then a final: no forged token and no forged end reaches the client, the
    gateway counts both refusals, and the bill holds exactly the tokens the client got."""
    import json

    import redis as redis_client
    from redis.exceptions import ResponseError

    from tests.e2e.meshkit import StreamRecorder
    r = redis_client.Redis.from_url(mesh.redis_url, decode_responses=True)
    before = _refused_events(mesh)
    client_id = f"inject-{uuid.uuid4().hex[:8]}"
    req = chat("Write a long story about a lighthouse keeper and the sea.", 200)
    req.request_id = client_id
    recorder = StreamRecorder(gateway, req, DEMO_KEYS["acme"])

    def live_stream():
        for k in r.scan_iter(match=f"llmmesh:res:{{acme/{client_id}/*", count=1000):
            if r.xlen(k):
                return k
    stream = wait_until(live_stream, 60, interval_s=0.01, what="the request's result stream")
    forged = [4242, 4243, 4244, 4245]
    for _ in range(50):   # the worker may take the index first: aim at the next one again
        last = queue.decode_event(r.xrevrange(stream, count=1)[0][1])
        assert last["kind"] == "tokens", "the request ended before the injection; make it longer"
        index = last["index"] + len(last["ids"])
        body = json.dumps({"kind": "tokens", "index": index, "ids": forged, "a": 10**6})
        try:
            r.xadd(stream, {"d": body, "m": "0" * 32}, id=queue.token_entry_id(index))
            break
        except ResponseError:
            continue
    else:
        pytest.fail("could not write ahead of the worker")
    r.xadd(stream, queue.final_event("stop", {"completion_tokens": 1, "prompt_tokens": 1}))
    recorder.thread.join(120)
    got = recorder.token_ids
    print(f"\n  injected at index {index}; client got {len(got)} tokens, "
          f"{'error ' + recorder.error.code().name if recorder.error else 'a final'}")
    assert all(got[i:i + 4] != forged for i in range(len(got)))
    assert len(got) == index                 # everything up to the forged chunk, nothing after it
    if recorder.final is not None:           # the forged final is not what ended it
        assert recorder.final.usage.completion_tokens == len(got)
    else:                                    # the worker could not write past the forgeries
        assert recorder.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    assert _refused_events(mesh) - before >= 2
    rows = wait_until(lambda: _ledger_rows(mesh, client_id) or None, 20, what="its bill")
    assert [row[2] for row in rows] == [len(got)]
