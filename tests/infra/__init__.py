"""Real test infrastructure: a local multi-node Slurm, a Prometheus server, the router venv."""
