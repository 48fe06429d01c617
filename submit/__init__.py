"""The thin submitter (``tilert-submit``): recipe -> plan -> job directory -> sbatch (or local)."""
