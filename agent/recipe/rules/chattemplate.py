"""The router and the prefill render chats alike: TileRT 0.1.6.post3's router-side tokenization.

TileRT's router (0.1.6.post3) renders and tokenizes chats itself when it has ``--model-path``
(``TILERT_ROUTER_TOKENIZE``, on by default) and sends the prefill token ids; it switches that off
silently (one log line) when its ``--chat-template`` / ``--default-chat-template-kwargs`` differ
from vLLM's. So both flags are one agreement: ``frontend.args`` must say what
``roles.prefill.args`` says (both unset, or both the same). A difference is refused before sbatch,
naming both keys; the agent passes nothing to either side on its own (docs/recipe.md).
"""

from __future__ import annotations

import json
from typing import Any

from agent.problems import Problem, error
from agent.recipe.model import ArgValue, Recipe, Role, find_arg

# The router's flags that must equal the prefill's (vLLM's flags of the same names).
AGREED_FLAGS = ("chat-template", "default-chat-template-kwargs")


def chat_template(recipe: Recipe, prefill: Role, out: list[Problem]) -> None:
    """``frontend.args.<flag>`` == ``roles.prefill.args.<flag>`` for each flag of AGREED_FLAGS."""
    for flag in AGREED_FLAGS:
        router = find_arg(recipe.frontend.args, flag)
        engine = find_arg(prefill.args, flag)
        if _value(flag, router) == _value(flag, engine):
            continue
        router_key = f"frontend.args.{router[0] if router else flag}"
        prefill_key = f"roles.prefill.args.{engine[0] if engine else flag}"
        out.append(
            error(
                router_key,
                f"the router's {flag} ({_shown(router)}) differs from the prefill's "
                f"{prefill_key} ({_shown(engine)}): TileRT's router then turns its own "
                "tokenization off (router_tokenize.on false in /pool_status)",
                f"set {router_key} and {prefill_key} to the same value, or leave both unset",
            )
        )


def _value(flag: str, found: tuple[str, ArgValue] | None) -> Any:
    """The flag's value compared: JSON kwargs parsed (a string or a mapping), text stripped."""
    if found is None:
        return None
    value = found[1]
    if flag == "default-chat-template-kwargs" and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value.strip()
    return value.strip() if isinstance(value, str) else value


def _shown(found: tuple[str, ArgValue] | None) -> str:
    if found is None:
        return "unset"
    text = found[1] if isinstance(found[1], str) else json.dumps(found[1], sort_keys=True)
    return repr(text if len(text) <= 80 else text[:77] + "...")
