"""The ``zinf`` command line. Errors a user can cause print as one line and exit with status 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from zinf.errors import ZinfError

app = typer.Typer(help="zinf: train models larger than GPU memory and DRAM, with placement decided by measurement.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Profile database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console()
err_console = Console(stderr=True)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="optimizer steps to train")] = 60,
    batch_size: Annotated[int, typer.Option(help="sequences per micro-batch")] = 8,
    workdir: Annotated[Path, typer.Option(help="where zinf-swap/, zinf-profile.db and zinf-checkpoints/ go")] = Path("."),
    dram_fraction: Annotated[float, typer.Option(help="DRAM budget as a fraction of the training state")] = 0.5,
    preset: Annotated[str, typer.Option(help="size of the built-in GPT: tiny, small or demo")] = "demo",
    profile: Annotated[bool, typer.Option(help="record into zinf-profile.db")] = True,
) -> None:
    """Train the built-in GPT with its state on DRAM and NVMe, profiled, and print a summary."""
    from zinf.demo import DemoSettings, run_demo

    run_demo(DemoSettings(steps=steps, batch_size=batch_size, workdir=workdir, dram_fraction=dram_fraction, profile=profile, preset=preset), console)


@db_app.command("upgrade")
def db_upgrade(db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db") -> None:
    """Create or migrate the profile database to the newest schema."""
    from profiler.store import current_revision, upgrade

    upgrade(db)
    console.print(f"{db} is at schema revision {current_revision(db)}")


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=False)
    except ZinfError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
