"""Builds ``recipes/local-demo-model``: a tiny byte-level BPE tokenizer for the demo and tests.

Nothing can come from a model hub here, so the tokenizer is trained locally on a fixed set of the
Python standard library's files. Its vocabulary starts with the special tokens and the 256 byte
symbols in sorted order (``agent.standins.tokens`` relies on that and this builder checks it), then
a few hundred merges. The folder is committed; rebuild it with an interpreter that has
``tokenizers`` and ``transformers`` (the router venv), from the repository root:

    /tmp/rv/bin/python -m tests.infra.tokenizer [DEST]
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from agent.standins import tokens

DEFAULT_DEST = Path(__file__).resolve().parents[2] / "recipes" / "local-demo-model"
VOCAB_SIZE = 512
# A fixed corpus, so a rebuild on another machine gives nearly the same merges.
CORPUS_MODULES = ("json", "email", "http", "logging", "argparse.py", "textwrap.py", "string.py")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_files() -> list[str]:
    """The training files, from this interpreter's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [str(f) for f in files if f.is_file()]


def build(dest: Path) -> None:
    """Train the tokenizer and write the model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(tokens.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    specials = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(tokens.SPECIAL_TOKENS)
    }
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": specials,
            "bos_token": None,
            "eos_token": tokens.EOS_TOKEN,
            "pad_token": tokens.PAD_TOKEN,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"eos_token": tokens.EOS_TOKEN, "pad_token": tokens.PAD_TOKEN},
        "generation_config.json": {"eos_token_id": tokens.EOS_ID, "pad_token_id": 0},
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "eos_token_id": tokens.EOS_ID,
            "max_position_embeddings": 4096,
        },
    }
    for name, data in files.items():
        (dest / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    check(dest)


def check(dest: Path) -> None:
    """Load the folder as TileRT's router does and check the stand-ins' token ids decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dest), trust_remote_code=True)
    for b in range(32, 127):
        got = tok.decode([tokens.byte_token_id(b)])
        if got != chr(b):
            raise SystemExit(f"byte {b} decodes to {got!r}: the vocabulary order changed")
    reply = tok.decode(
        [tokens.first_token_id(), *tokens.continuation_ids()], skip_special_tokens=True
    )
    expected = tokens.FIRST_TOKEN_TEXT + tokens.CONTINUATION_TEXT
    if reply != expected:
        raise SystemExit(f"the stand-in reply decodes to {reply!r}, not {expected!r}")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if not prompt.endswith("<|im_start|>assistant\n"):
        raise SystemExit(f"chat template renders {prompt!r}")
    if tok.eos_token_id != tokens.EOS_ID:
        raise SystemExit(f"eos_token_id is {tok.eos_token_id}, want {tokens.EOS_ID}")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST
    build(target)
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"wrote {target} ({size} bytes)")
