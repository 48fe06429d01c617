"""The thin submitter (``tilert-submit``): recipe -> plan -> job directory -> sbatch (or local)."""

# The command's name, as its messages and hints spell it.
PROG = "tilert-submit"
