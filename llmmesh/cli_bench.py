"""`llmmesh bench`: replay a traffic profile against the mesh and its peers (the bench package)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def bench(
    profile: str = typer.Option(..., help="chatbot, summarisation, diurnal, mixed, curve, "
                                          "or a path to a profile .toml"),
    scale: float = typer.Option(1.0, help="multiplies every arrival rate (fit to the machine)"),
    duration: float = typer.Option(None, help="seconds of arrivals per level (profile's default)"),
    targets: str = typer.Option("", help="comma-separated among mesh,worker,llamacpp, run in "
                                         "this order (default: the profile's, else all three)"),
    out: str = typer.Option("bench/results", help="where <profile>.md/.json and PNGs go"),
    rates: str = typer.Option("", help="sweep factors, e.g. 0.5,1,2 (profile's default)"),
    max_requests: int = typer.Option(0, help="cap on requests per level (0: profile's)"),
    workers: int = typer.Option(1, help="workers in the private mesh"),
    worker_args: str = typer.Option("", help="extra worker flags, e.g. \"--dtype bfloat16\""),
    llamacpp_parallel: int = typer.Option(32, help="llama-server --parallel (slots); 32 = the "
                                                   "worker's default --max-num-seqs"),
    threads: int = typer.Option(0, help="llama-server -t (0: llama.cpp's default, its count "
                                        "of physical cores)"),
    gateway: str = typer.Option("", help="bench an already running mesh at this gateway"),
    costd: str = typer.Option("", help="its costd (with --gateway)"),
    var_dir: str = typer.Option("var/bench", help="logs of the processes the bench starts"),
    curves_dir: str = typer.Option("bench/curves", help="where a closed-loop run writes its curve"),
    progress: bool = typer.Option(True, help="show progress bars"),
) -> None:
    """Replay a traffic profile (open-loop Poisson arrivals) and report latency, throughput, cost."""
    import os
    import shlex
    import sys

    from bench.main import Request, run  # local: `llmmesh up` should not import matplotlib

    # As typed, for the report: `llmmesh bench …` or `python -m bench …`.
    via_module = os.path.basename(sys.argv[0]) == "__main__.py"
    command = ("python -m bench " if via_module else "llmmesh ") + shlex.join(sys.argv[1:])

    if gateway and not costd:
        raise typer.BadParameter("--gateway needs --costd too (the run is priced by costd)")
    results = run(Request(profile=profile, scale=scale, duration_s=duration, targets=targets,
                          out_dir=out, rates=rates, max_requests=max_requests, workers=workers,
                          worker_args=worker_args,
                          llamacpp_parallel=llamacpp_parallel, threads=threads, gateway=gateway,
                          costd=costd, var_dir=var_dir, curves_dir=curves_dir, progress=progress),
                  command)
    for line in results["verdicts"]:
        if line.startswith(("- ", "| ", "###")):
            typer.echo(line)
    typer.echo("wrote " + ", ".join(results["written"]))
