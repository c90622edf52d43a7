"""python -m bench --profile chatbot …: the same command as `llmmesh bench`."""
import typer

from llmmesh.cli_bench import register

app = typer.Typer(add_completion=False)
register(app)

if __name__ == "__main__":
    app()
