"""`llmmesh batch …`: submit a JSONL file as a batch job, follow it with a progress bar,
export its results as JSONL, cancel it."""
from __future__ import annotations

import json
import os
import sys
import time

import grpc
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

batch_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Batch jobs: many prompts, one job id.")
GATEWAY = typer.Option("127.0.0.1:50051", help="gateway address")
API_KEY = typer.Option(..., envvar="LLMMESH_API_KEY", help="tenant API key")


def _metadata(api_key: str):
    return (("authorization", f"Bearer {api_key}"),)


def _request(line: dict, default_max_tokens: int) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(model=line.get("model", ""))
    req.sampling.max_tokens = int(line.get("max_tokens", default_max_tokens))
    req.sampling.temperature = float(line.get("temperature", 0.0))
    if "messages" in line:
        for m in line["messages"]:
            req.messages.add(role=m["role"], content=m["content"])
    else:
        req.prompt = line.get("prompt", "")
    return req


def _call(fn):
    try:
        return fn()
    except grpc.RpcError as exc:
        typer.echo(f"error: {exc.code().name}: {exc.details()}", err=True)
        raise typer.Exit(1)


def _follow(stub, job_id: str, api_key: str) -> gateway_pb2.BatchJob:
    with Progress(TextColumn("job {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn()) as bar:
        task = None
        while True:
            job = _call(lambda: stub.GetBatch(gateway_pb2.GetBatchRequest(job_id=job_id),
                                              metadata=_metadata(api_key), timeout=10))
            if task is None:
                task = bar.add_task(job_id[:8], total=job.num_requests, failed=0)
            bar.update(task, completed=job.num_completed + job.num_failed, failed=job.num_failed)
            if job.status != gateway_pb2.BATCH_STATUS_RUNNING:
                return job
            time.sleep(0.5)


@batch_app.command()
def submit(file: str = typer.Argument(..., help='JSONL: {"prompt": …} or {"messages": […]} per line'),
           gateway: str = GATEWAY, api_key: str = API_KEY,
           max_tokens: int = typer.Option(128, help="default max_tokens per line"),
           name: str = typer.Option("", help="display name"),
           wait: bool = typer.Option(False, "--wait", help="show a progress bar until the job ends")) -> None:
    """Submit FILE as one batch job and print its id."""
    with open(file) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    req = gateway_pb2.SubmitBatchRequest(requests=[_request(x, max_tokens) for x in lines],
                                         display_name=name or os.path.basename(file))
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        job = _call(lambda: stub.SubmitBatch(req, metadata=_metadata(api_key), timeout=60)).job
        typer.echo(job.job_id)
        if wait:
            job = _follow(stub, job.job_id, api_key)
            typer.echo(f"{gateway_pb2.BatchStatus.Name(job.status)}: {job.num_completed} completed, "
                       f"{job.num_failed} failed", err=True)


@batch_app.command()
def status(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY,
           wait: bool = typer.Option(False, "--wait", help="follow with a progress bar")) -> None:
    """Print a job's progress."""
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        job = _follow(stub, job_id, api_key) if wait else _call(lambda: stub.GetBatch(
            gateway_pb2.GetBatchRequest(job_id=job_id), metadata=_metadata(api_key), timeout=10))
    typer.echo(f"{job.job_id} {gateway_pb2.BatchStatus.Name(job.status)} "
               f"{job.num_completed + job.num_failed}/{job.num_requests} done "
               f"({job.num_failed} failed) prompt_tokens={job.prompt_tokens} "
               f"completion_tokens={job.completion_tokens}")


@batch_app.command()
def results(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY,
            out: str = typer.Option("-", help="JSONL file, - for stdout")) -> None:
    """Stream a job's results as JSONL (in completion order; `index` is the input line)."""
    sink = sys.stdout if out == "-" else open(out, "w")
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stream = stub.StreamBatchResults(gateway_pb2.StreamBatchResultsRequest(job_id=job_id),
                                         metadata=_metadata(api_key))
        for r in _call(lambda: list(stream)):
            row = {"index": r.index, "request_id": r.request_id, "text": r.text}
            if r.error_code:
                row["error"] = {"code": r.error_code, "message": r.error_message}
            else:
                row["finish_reason"] = common_pb2.FinishReason.Name(r.final.finish_reason)
                row["usage"] = {"prompt_tokens": r.final.usage.prompt_tokens,
                                "completion_tokens": r.final.usage.completion_tokens}
            sink.write(json.dumps(row) + "\n")
    if sink is not sys.stdout:
        sink.close()


@batch_app.command()
def cancel(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Cancel the job's unfinished requests."""
    with grpc.insecure_channel(gateway) as channel:
        job = _call(lambda: gateway_pb2_grpc.GatewayServiceStub(channel).CancelBatch(
            gateway_pb2.CancelBatchRequest(job_id=job_id), metadata=_metadata(api_key), timeout=30))
    typer.echo(f"{job.job_id} {gateway_pb2.BatchStatus.Name(job.status)}")


def register(app: typer.Typer) -> None:
    app.add_typer(batch_app, name="batch")
