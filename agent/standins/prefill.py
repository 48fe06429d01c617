"""Stand-in for vLLM's OpenAI server (``vllm serve MODEL ...``), TileRT's connector plugged in.

``/health`` (connection refused while "loading", then 200 with an empty body), ``/v1/models``,
``/version``, ``/metrics`` (vLLM's ``vllm:`` families, classic text), ``POST /v1/chat/completions``
and ``POST /v1/completions`` (the router asks for ``max_tokens=1``; logprob tokens read
``token_id:N`` with ``--return-tokens-as-token-ids``), ``POST /tokenize`` with the model's own
token ids (``agent.standins.bpe``; one id per byte when the model folder has no byte-level BPE),
so TileRT's router turns its router-side tokenization on and sends chats without logprobs to
``/v1/completions`` as token ids, as it does against vLLM. With ``--kv-transfer-config`` naming
``TileRTConnector``, a request carrying
``kv_transfer_params`` is handed to the connector's sending side (``agent.standins.kvlink``),
which shakes hands with that decode node's ctrl port. SIGTERM exits 0, as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import prometheus_client
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.facts import CONNECTOR, PREFILL_KV_DEFAULT, human_int
from agent.standins import lifecycle, openai_api, tokens
from agent.standins.bpe import ByteLevelBPE
from agent.standins.faults import Crasher, Faults
from agent.standins.kvlink import ConnectorConfig, Sender
from agent.web.asgi import (
    App,
    HTTPError,
    Request,
    Response,
    StreamingResponse,
    json_response,
    text_response,
)
from agent.web.server import bound_socket, serve

log = logging.getLogger("vllm.entrypoints.openai.api_server")

VERSION = "0.0.0+standin"
TERM_EXIT_CODE = 0
METRICS_CONTENT_TYPE = prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4
DEFAULT_MAX_MODEL_LEN = 4096
# vLLM's default when a plain request names no max_tokens is "the rest of the context"; the
# stand-in's reply is short anyway.
DEFAULT_MAX_TOKENS = 64
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


def _model_len(raw: str) -> int:
    """vLLM's --max-model-len: an integer or a size (1k = 1000, 1K = 1024), as the rules read it."""
    value = human_int(raw)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a length: {raw!r} (examples: 4096, 128k, 198K)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The vLLM flags the stand-in honours."""
    ap = argparse.ArgumentParser(prog="vllm", allow_abbrev=False, epilog=lifecycle.HELP_EPILOG)
    ap.add_argument("subcommand", nargs="?", help="'serve'")
    ap.add_argument("model_tag", nargs="?")
    ap.add_argument("--model", default=None)
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None)
    ap.add_argument("--return-tokens-as-token-ids", action="store_true")
    ap.add_argument("--kv-transfer-config", type=json.loads, default=None)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=_model_len, default=None)
    ap.add_argument("--kv-cache-dtype", default=PREFILL_KV_DEFAULT)
    return ap


class Metrics:
    """The ``vllm:`` families a scraper reads, in a registry of their own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # vLLM serves its process's default collectors too (they clash with any exporter's own).
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vllm:{name}", doc, names, registry=reg).labels(**labels)

        self.running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=reg
        ).labels(**labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=reg
        ).labels(**labels)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(**labels, finished_reason=reason)
        self._labels = labels
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(**labels)

    def finished(
        self, reason: str, prompt_tokens: int, generated: int, ttft: float, e2e: float
    ) -> None:
        """Record one finished request."""
        self._success.labels(**self._labels, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def page(self) -> bytes:
        """The classic text exposition."""
        return prometheus_client.generate_latest(self.registry)


def _prompt_text(body: dict[str, Any], is_chat: bool) -> str:
    """The prompt as the model would see it (the demo model's ChatML template for chat)."""
    if not is_chat:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return "".join(str(p) for p in prompt)
        return str(prompt)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list")
    # vLLM's ``continue_final_message``: the last message left open (no end of turn), to be
    # continued; it refuses it together with a generation prompt.
    open_end = bool(body.get("continue_final_message"))
    generation = bool(body.get("add_generation_prompt", True))
    if open_end and generation:
        raise HTTPError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    parts = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        role = m.get("role", "user") if isinstance(m, dict) else "user"
        parts.append(f"<|im_start|>{role}\n{content or ''}<|im_end|>\n")
    if open_end:
        parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
    return "".join(parts) + (tokens.ASSISTANT_TURN if generation else "")


def _error(
    message: str, status: int, kind: str = "BadRequestError", param: str | None = None
) -> Response:
    return json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


class PrefillServer:
    """The stand-in vLLM server's state."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: str,
        faults: Faults,
        crasher: Crasher,
        sender: Sender | None,
    ) -> None:
        self.model = model
        self.served = args.served_model_name or [model]
        self.token_ids = args.return_tokens_as_token_ids
        self.max_model_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.faults = faults
        self.crasher = crasher
        self.metrics = Metrics(self.served[0])
        self.sender = sender
        # The model's tokenizer when its folder has one we can read (TileRT's router compares).
        self.tokenizer = ByteLevelBPE.load(model)

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's token ids (one per UTF-8 byte without a tokenizer)."""
        return self.tokenizer.encode(text) if self.tokenizer else tokens.encode_bytes(text)

    def prompt_tokens(self, body: dict[str, Any], text: str) -> int:
        """How many tokens a request's prompt is (its ids when it sends ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return max(1, len(self.encode(text)))

    def token_text(self, token_id: int) -> str:
        """How a logprob entry names a token."""
        return f"token_id:{token_id}" if self.token_ids else tokens.render([token_id])

    def build_app(self) -> App:
        """The OpenAI-compatible HTTP app."""
        app = App()

        @app.route("GET", "/health")
        async def health(_request: Request) -> Response:
            await self.faults.hold_health()
            return Response(b"", 200, "application/octet-stream")

        @app.route("GET", "/version")
        async def version(_request: Request) -> Response:
            return json_response({"version": VERSION})

        @app.route("GET", "/v1/models")
        async def models(_request: Request) -> Response:
            data = [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                }
                for name in self.served
            ]
            return json_response({"object": "list", "data": data})

        @app.route("GET", "/metrics")
        async def metrics(_request: Request) -> Response:
            path = self.faults.metrics_file
            if path is None:
                return Response(self.metrics.page(), 200, METRICS_CONTENT_TYPE)
            try:
                data = await trio.Path(path).read_bytes()
            except OSError as exc:
                return text_response(f"cannot read TILERT_MOCK_METRICS_FILE: {exc}\n", 500)
            return Response(data, 200, METRICS_CONTENT_TYPE)

        @app.route("POST", "/tokenize")
        async def tokenize(request: Request) -> Response:
            return self.tokenize(await request.json())

        @app.route("POST", "/v1/chat/completions")
        async def chat(request: Request) -> Response | StreamingResponse:
            return await self.complete(await request.json(), is_chat=True)

        @app.route("POST", "/v1/completions")
        async def completions(request: Request) -> Response | StreamingResponse:
            return await self.complete(await request.json(), is_chat=False)

        return app

    def tokenize(self, body: Any) -> Response:
        """vLLM's ``/tokenize``: a chat (``messages``, rendered with the template) or a prompt."""
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400)
        name = body.get("model") or self.served[0]
        if name not in self.served:
            return _error(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
        if "messages" in body:
            ids = self.encode(_prompt_text(body, is_chat=True))
        elif isinstance(body.get("prompt"), str):
            ids = self.encode(body["prompt"])
        else:
            return _error("either messages or prompt is required", 400)
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def complete(self, body: Any, *, is_chat: bool) -> Response | StreamingResponse:
        """Answer one completion request, then hand its KV to the decode node it names."""
        t0 = time.monotonic()
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400)
        name = body.get("model") or self.served[0]
        if name not in self.served:
            return _error(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
        text = _prompt_text(body, is_chat)
        n_prompt = self.prompt_tokens(body, text)
        max_tokens = openai_api.max_tokens(body, DEFAULT_MAX_TOKENS)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error("max_tokens must be at least 1", 400, param="max_tokens")
        if n_prompt + max_tokens > self.max_model_len:
            return _error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                f"{max_tokens} "
                "in the completion). Please reduce the length of the messages or completion.",
                400,
            )
        # The model's reply from where the context's last assistant turn leaves it (the start:
        # a plain chat); the decode continues from the same place (``reply_at`` in the KV).
        at = tokens.reply_at(text)
        reply = tokens.reply_ids(at, max_tokens, ignore_eos=bool(body.get("ignore_eos")))
        finish = "stop" if reply[-1] == tokens.EOS_ID else "length"
        visible = [t for t in reply if t != tokens.EOS_ID]
        response_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{secrets.token_hex(16)}"
        # vLLM's engine-side id carries a suffix ("-0" per prompt for completions, then a random
        # "-<8 hex>"); the connector derives the rid from it, the router from the response id.
        internal_id = f"{response_id}{'' if is_chat else '-0'}-{secrets.token_hex(4)}"
        self.metrics.running.inc()
        try:
            params = body.get("kv_transfer_params")
            if self.sender is not None and isinstance(params, dict) and params.get("tilert_host"):
                self.sender.claim(internal_id, params, n_prompt, openai_api.sampling(body), at)
            created = int(time.time())
            # vLLM's UsageInfo order.
            usage = {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt + len(reply),
                "completion_tokens": len(reply),
            }
            ttft = time.monotonic() - t0
            self.metrics.finished(finish, n_prompt, len(reply), ttft, time.monotonic() - t0)
            if body.get("stream"):
                return StreamingResponse(
                    self.sse(response_id, name, created, visible, finish, is_chat, usage, body),
                    content_type="text/event-stream",
                )
            content = tokens.render(visible)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": []}
                choice["logprobs"] = (
                    self.chat_logprobs(reply, body) if body.get("logprobs") else None
                )
            else:
                choice["text"] = content
                want = body.get("logprobs")
                choice["logprobs"] = (
                    self.completion_logprobs(reply, int(want)) if want is not None else None
                )
            return json_response(
                {
                    "id": response_id,
                    "object": openai_api.object_name(is_chat),
                    "created": created,
                    "model": name,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        finally:
            self.metrics.running.dec()
            self.crasher.request_answered()

    def chat_logprobs(self, reply: list[int], body: dict[str, Any]) -> dict[str, Any]:
        """Chat logprobs: one entry per token, named ``token_id:N`` when asked."""
        top = int(body.get("top_logprobs") or 0)
        entries = []
        for t in reply:
            name = self.token_text(t)
            alts = [
                {"token": self.token_text(t + k), "logprob": -0.1 - k, "bytes": None}
                for k in range(top)
            ]
            entries.append(
                {"token": name, "logprob": -0.1, "bytes": list(name.encode()), "top_logprobs": alts}
            )
        return {"content": entries}

    def completion_logprobs(self, reply: list[int], top: int) -> dict[str, Any]:
        """Completions logprobs (the legacy layout)."""
        names = [self.token_text(t) for t in reply]
        return {
            "tokens": names,
            "token_logprobs": [-0.1] * len(reply),
            "top_logprobs": [{n: -0.1} for n in names] if top else None,
            "text_offset": list(range(len(reply))),
        }

    async def sse(
        self,
        response_id: str,
        model: str,
        created: int,
        visible: list[int],
        finish: str,
        is_chat: bool,
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        """A streamed reply, one token per chunk."""
        stream = openai_api.ChunkStream(
            response_id, openai_api.chunk_object_name(is_chat), created, model
        )
        if is_chat:
            yield stream.event(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        for t in visible:
            text = tokens.render([t])
            delta: dict[str, Any] = {"delta": {"content": text}} if is_chat else {"text": text}
            yield stream.event([{"index": 0, **delta, "finish_reason": None}])
        yield stream.event(
            [{"index": 0, **({"delta": {}} if is_chat else {"text": ""}), "finish_reason": finish}]
        )
        if openai_api.include_usage(body):
            yield stream.event([], usage=usage)
        yield openai_api.SSE_DONE


def _sender(args: argparse.Namespace, nursery: trio.Nursery, faults: Faults) -> Sender | None:
    """The connector's sending side when ``--kv-transfer-config`` names TileRT's connector."""
    config = args.kv_transfer_config
    if not config:
        return None
    if config.get("kv_connector") != CONNECTOR:
        log.warning(
            "kv connector %r is not emulated; no KV will be sent", config.get("kv_connector")
        )
        return None
    connector = ConnectorConfig.from_config(
        config,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    connector.announce()
    return Sender(connector, nursery, no_kv=faults.no_kv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m agent.standins.prefill serve MODEL [vllm flags]``."""
    lifecycle.setup_logging(
        "%(levelname)s %(asctime)s [%(module)s.py:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"
    )
    parser = build_parser()
    # vLLM's --help=all (and --help=GROUP) prints its flags like --help does.
    words = sys.argv[1:] if argv is None else argv
    args = lifecycle.parse_known(
        parser, ["--help" if w.startswith("--help=") else w for w in words]
    )
    if args.subcommand not in (None, "serve") and args.model_tag is None:
        args.model_tag = args.subcommand  # `python -m vllm.entrypoints.openai.api_server`-style
    model = args.model_tag or args.model
    if not model:
        parser.error("the model is required: `serve MODEL` or --model MODEL")
    faults = lifecycle.load_faults()
    log.info("vLLM API server version %s", VERSION)
    log.info(
        "non-default args: %s", {k: v for k, v in vars(args).items() if v not in (None, False)}
    )

    async def body(nursery: trio.Nursery, crasher: Crasher, shutdown: trio.Event) -> None:
        server = PrefillServer(args, model, faults, crasher, _sender(args, nursery, faults))
        if not await lifecycle.loading(faults, shutdown, "prefill"):
            return
        host = args.host or "0.0.0.0"
        sock = bound_socket(host, args.port)
        log.info("Starting vLLM API server 0 on http://%s:%d", host, args.port)
        log.info("Started server process [%d]", os.getpid())
        log.info("Waiting for application startup.")
        log.info("Application startup complete.")
        await serve(server.build_app(), sock, shutdown=shutdown)

    lifecycle.run("prefill", faults, body, term_exit_code=TERM_EXIT_CODE)


if __name__ == "__main__":
    main()
