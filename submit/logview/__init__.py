"""``tilert-submit logs``: a job's logs with name prefixes, followed until the job ends.

``command`` is the CLI (arguments, checks, the fast path without trio); ``catalogue`` says which
sources there are and where each is read; ``printer`` prints them; ``follow`` follows them under
trio and ends with the job (``jobend``); ``remote`` reads node-local logs through the agents.
"""

from submit.logview.command import add_arguments, main

__all__ = ["add_arguments", "main"]
