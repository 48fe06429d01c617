"""The HTTP server toolkit: a small ASGI layer (``asgi``) served on hypercorn + trio (``server``),
or, for the fronts whose cost is per streamed event, on h11 + trio streams (``h11server``).

A base layer, so that the agent's endpoint (``agent.http``) and the stand-in engines
(``agent.standins``) serve HTTP the same way without the stand-ins importing the agent.

May import: the standard library, trio, hypercorn, h11, msgspec and ``agent.errors`` (the error
tree); nothing else of ``agent``.
"""
