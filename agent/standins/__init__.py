"""Stand-ins for the GPU engines: vLLM prefill with TileRT's connector, TileRT decode and router.

Product code: ``tilert-submit --mock`` and the local demo run them instead of the engines, and
tests drive the real TileRT router against them. Each takes its engine's argument list (unknown
flags are accepted and logged), speaks its HTTP and ctrl-port protocols, and exits with its
codes; docs/standins.md describes them.

The programs (what ``agent.launch.commands.STANDIN_MODULES`` runs):

- ``prefill``: vLLM's OpenAI server (``python -m agent.standins.prefill serve MODEL ...``); with
  ``--kv-transfer-config`` naming TileRT's connector, it hands each request to the ``kvlink``
  sender.
- ``decode``: TileRT's decode server (``python -m agent.standins.decode ...``): its HTTP app, and
  the ``kvlink`` receiver on the ctrl port.
- ``router``: TileRT's P/D router (``python -m agent.standins.router ...``), for where the real
  one cannot run.
- ``converter``: TileRT's weight converter (``python -m agent.standins.converter ...``), run by a
  decode agent that converts its weights folder.

Not a program but a folder for a REAL vLLM's import path: ``vllm_connector`` holds a
``tilert.pd_vllm.prefill_connector`` whose ``TileRTConnector`` does TileRT's control-plane
handshake with the ``kvlink`` sender and moves no KV (``--mock decode`` beside a real vLLM).

What they share:

- ``kvlink``: the two ends of the ctrl-port conversation, the connector's sender (prefill) and
  the receive server (decode);
- ``wire``: that conversation's frames and messages, the rid, the layout version;
- ``openai_api``: the OpenAI request fields and streamed-reply framing of prefill and router;
- ``tokens``: the token ids they emit and their text without a tokenizer; ``bpe``: the model's
  own byte-level BPE, for the prefill's ``/tokenize``;
- ``faults``: the ``TILERT_MOCK_*`` fault switches; ``failmodes``: ``TILERT_MOCK_FAILURE``, each
  known failure's real message in its program's log; ``lifecycle``: parse, load, serve, stop;
- ``tilertlog``: TileRT's log format (``decode_server.py:106 [INFO]: REQSTAT ...``) for the decode.

May import: the standard library, third-party packages, ``agent.facts`` (what TileRT and vLLM are),
``agent.errors`` (the error tree) and ``agent.web`` (the HTTP toolkit); nothing else of ``agent``,
so a stand-in is as independent of the agent as the engine it replaces. Nothing imports a stand-in:
the agent runs them by module name.
"""
