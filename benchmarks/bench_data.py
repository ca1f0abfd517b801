"""Seeded benchmark data with long-tailed lengths, like public instruction sets.

Instruction sets are mostly short samples with a long tail. Each record here draws a target length from a
log-normal with median 150 and 90th percentile 500 tokens, so a tail runs past 1,024 (such samples are cut
at the context length, as the pipeline does); `benchmarks/training_speed.py` prints the lengths it got after
tokenizing. The tasks are learnable (copying, reversing, counting, templated stories), so a held-out loss
can tell trainers apart.

    python -m qlora_fsdp.tools.bench_data --out /tmp/bench.jsonl --records 1000
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

MEDIAN_TOKENS, P90_TOKENS = 150, 500
SIGMA = math.log(P90_TOKENS / MEDIAN_TOKENS) / 1.2816  # z of the 90th percentile
PROMPT_TOKENS = 16  # the alpaca template and the instruction, roughly
TOKENS_PER_WORD = 1.1  # the benchmark tokenizer's, measured on this data
SYLLABLES = "ka lo mi ra sun tor vel pa din qua ber zo lin fe mar ost ul chi ne vor".split()
NOUNS = "river stone cloud tiger lamp garden mirror pencil rocket forest window planet castle dragon bridge".split()
ADJECTIVES = "quiet bright silver ancient little golden hidden gentle frozen hollow".split()
VERBS = "finds follows paints carries watches builds crosses remembers".split()
Record = dict[str, str]


def vocabulary(rng: random.Random, size: int = 400) -> list[str]:
    words = {"".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(size * 2)}
    return sorted(words)[:size]


def copy_text(words: list[str]) -> Record:
    text = " ".join(words)
    return {"instruction": "Repeat the text exactly.", "input": text, "output": text}


def reverse_order(words: list[str]) -> Record:
    return {"instruction": "Write the words in reverse order.", "input": " ".join(words),
            "output": " ".join(reversed(words))}


def capitals(words: list[str]) -> Record:
    text = " ".join(words)
    return {"instruction": "Write the text in capital letters.", "input": text, "output": text.upper()}


def count_up(rng: random.Random, n_words: int) -> Record:
    start = rng.randint(0, 500)
    return {"instruction": f"Count up from {start}, {n_words} numbers.", "input": "",
            "output": " ".join(str(start + i) for i in range(n_words))}


def story(rng: random.Random, n_words: int) -> Record:
    hero = rng.choice(NOUNS)
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(f"The {rng.choice(ADJECTIVES)} {hero} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} "
                         f"{rng.choice(NOUNS)}.")
    return {"instruction": f"Tell a story about a {hero}.", "input": "", "output": " ".join(sentences)}


def target_tokens(rng: random.Random) -> int:
    return max(PROMPT_TOKENS + 4, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA)))


def record(rng: random.Random, words: list[str]) -> Record:
    tokens = round((target_tokens(rng) - PROMPT_TOKENS) / TOKENS_PER_WORD)
    copies: list[Callable[[list[str]], Record]] = [copy_text, reverse_order, capitals]
    kind = rng.randrange(5)
    if kind < 3:  # input and output the same length: half the tokens each
        return copies[kind](rng.choices(words, k=max(1, tokens // 2)))
    return count_up(rng, tokens) if kind == 3 else story(rng, tokens)


def generate(n_records: int, seed: int) -> list[Record]:
    rng = random.Random(seed)
    words = vocabulary(rng)
    return [record(rng, words) for _ in range(n_records)]


def write(path: Path, records: list[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args()
    write(args.out, generate(args.records, args.seed))
    print(f"wrote {args.records} records to {args.out}")


if __name__ == "__main__":
    main()
