"""The node runtime's parts: who this agent is, its ports, its rendezvous record, its engine.

``identity`` (index, node, address), ``ports`` (probe bindable ports), ``rendezvous`` (write our
record, read and watch the others', trusting no file), ``ownrecord`` (this agent's ports, versions
and last word, published in its record), ``statuswriter`` (status.json and targets.json, for the
head and a convert job), ``jobwrites`` (writes into the job directory that may fail: retried, shown,
never fatal), ``supervisor`` (one engine's state machine: probe, restart, give up), ``handover`` (an
engine replaced on its ports, the old one draining beside: the router's hand-over), ``enginefate``
(how a generation ended, in words), ``enginepreflight`` (the node, the engine's environment and its
flags, checked before the load), ``logpump`` (engine output to rotated files, never blocking the
engine; watchers see the lines as they pass), ``rotatedfile`` (the log file, rotated by size,
written from a worker thread), ``enginewatch`` (startup progress and failure signatures in those
lines), ``decodestats`` (a TileRT decode's figures from its REQSTAT lines and ``/decode_status``,
the router's pool), ``agentlog`` (the agent's own log), the decode's weights: ``weightsfolder``
(complete or not, the marker, its path through the mounts), ``folderlock`` (a lock on a shared file
system), ``mounts`` (engine paths through the container mounts), ``hubcache`` (a hub id's snapshot
in the Hugging Face cache), ``converter`` (TileRT's converter: its preflight, its run, its marker)
and ``conversion`` (the gate before the engine: check, wait, or convert once) with ``converting``
(this agent converting under the lock), ``leave`` (a decode leaving the pool: drained to idle, then
stopped), ``jobend`` (the head ends the whole job), ``jobwatch`` (a worker sees the job's end and
ends with it), ``secretenv`` (the secrets its processes expect from its environment, those missing
said at start), and for systemd ``sdnotify`` (its notification protocol) and ``servicenotes`` (what
the agent tells it: readiness, status, watchdog, stop). ``agent.nodeagent`` puts them together;
``agent.head`` uses them too.

May import: the standard library, trio, httpx, psutil, msgspec, ``agent.facts``,
``agent.signatures``, ``agent.problems``, ``agent.errors``, ``agent.job`` and ``agent.launch``.
Never ``agent.http``, ``agent.head`` or ``agent.nodeagent``.
"""
