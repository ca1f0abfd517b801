"""Write a tiny sentencepiece tokenizer in Gemma's released form (tokenizer.model beside tokenizer.json and
tokenizer_config.json, a turn-based chat template): `python tests/sentencepiece_tokenizer.py DATA.jsonl OUT`.

sentencepiece is installed only in llama.cpp's converter folder (requirements-gguf.txt), so this runs as a
subprocess with that folder on PYTHONPATH (tests/test_gguf_export.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sentencepiece
from transformers import AutoTokenizer

PIECES = 600
TURN_MARKERS = ["<start_of_turn>", "<end_of_turn>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def main(data: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    texts = (" ".join(filter(None, (r["instruction"], r.get("input"), r["output"]))) for r in records)
    # Gemma's ids: <pad> 0, </s> 1, <s> 2, <unk> 3; its mask token in the vocabulary so none is added after it
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=texts, model_prefix=str(out / "tokenizer"), vocab_size=PIECES, model_type="bpe",
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=[*TURN_MARKERS, "<mask>"],
        minloglevel=2)
    (out / "tokenizer.vocab").unlink()
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer", **special}))
    tokenizer = AutoTokenizer.from_pretrained(out)  # converted from tokenizer.model by transformers
    assert len(tokenizer) == PIECES, len(tokenizer)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
