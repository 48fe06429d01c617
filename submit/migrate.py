"""``tilert-submit migrate RECIPE [-o FILE] [--force]``: a schema-1 TileRT recipe as schema 2.

The schema-2 text (agent.recipe.migrate, comments kept) goes to stdout or, with ``-o``,
atomically to FILE (a regular file or nothing there; an existing one only with ``--force``:
``submit.outfile``); a file that is not schema 1, or a key whose meaning cannot be kept, exits 2
and writes nothing. The recipe is also loaded here (with the cluster file found as for a
submission) and what that finds is said on stderr: the schema-2 file inherits it (docs/cli.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent.errors import EXIT_BAD_INPUT
from agent.problems import InputError, printable, render_problems
from agent.recipe.cluster import find_cluster_file, read_cluster
from agent.recipe.loader import load_recipe
from agent.recipe.migrate import migrate_text
from agent.recipe.textfile import read_text
from submit import PROG
from submit.outfile import STDOUT, output_problem, write_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """migrate's arguments."""
    parser.add_argument(
        "recipe", metavar="RECIPE", help="a srtctl schema-1 recipe (backend.type: tilert)"
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=STDOUT,
        help=f"write here, a new regular file (default: {STDOUT}, standard output)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace FILE when it exists (a regular file only)"
    )
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster file (default: $TILERT_CLUSTER_FILE, else ./srtslurm.yaml, else none)",
    )


def main(args: argparse.Namespace) -> int:
    """Translate and write; 2 when it is no schema-1 recipe or a key cannot be kept."""
    path = Path(args.recipe)
    try:
        text = read_text(path, "recipe")
        migrated = migrate_text(text, str(path))
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = output_problem(args.output, force=args.force)
    if problem is not None:
        print(f"{PROG} migrate: {printable(problem)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _check(path, args.cluster)
    try:
        out = write_output(args.output, migrated)
    except OSError as exc:
        why = exc.strerror or exc
        print(f"{PROG} migrate: -o {printable(args.output)}: {why}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if out is not None:
        print(f"{printable(str(out))}: schema 2, from {printable(str(path))}", file=sys.stderr)
    return 0


def _check(path: Path, cluster_flag: str | None) -> None:
    """Say on stderr what loading the recipe here finds: the migrated file inherits it."""
    try:
        cluster_file = find_cluster_file(cluster_flag, os.environ, Path.cwd())
        cluster = read_cluster(cluster_file)[0] if cluster_file is not None else None
        loaded = load_recipe(path, cluster=cluster)
    except InputError as exc:
        print(
            f"{PROG} migrate: migrated as it is; loading it here finds what the schema-2 file "
            f"will too:\n{exc}",
            file=sys.stderr,
        )
        return
    if loaded.warnings:
        print(render_problems(loaded.warnings, loaded.source), file=sys.stderr)
