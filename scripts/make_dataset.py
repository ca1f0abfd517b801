"""Generate the shipped alpaca-format instruction dataset of simple, learnable tasks.

Seeded, so `python scripts/make_dataset.py` reproduces data/tiny_instruct.jsonl byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

WORDS = (
    "apple river stone cloud tiger lamp garden mirror pencil rocket candle forest window planet "
    "button silver ocean castle dragon bridge meadow violin winter summer basket honey marble "
    "shadow thunder feather pepper lemon coffee orange yellow purple copper falcon rabbit"
).split()
COUNTRIES = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa", "Norway": "Oslo", "Chile": "Santiago",
    "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Ireland": "Dublin", "India": "New Delhi",
}
Record = dict[str, str]


def reverse_word(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"instruction": "Reverse the letters of the word.", "input": word, "output": word[::-1]}


def add_numbers(rng: random.Random) -> Record:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"instruction": f"What is {a} plus {b}?", "input": "", "output": str(a + b)}


def uppercase(rng: random.Random) -> Record:
    words = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
    return {"instruction": "Write the text in capital letters.", "input": words, "output": words.upper()}


def capital_city(rng: random.Random) -> Record:
    country = rng.choice(sorted(COUNTRIES))
    return {"instruction": f"What is the capital of {country}?", "input": "",
            "output": f"The capital of {country} is {COUNTRIES[country]}."}


def sort_words(rng: random.Random) -> Record:
    words = rng.sample(WORDS, rng.randint(2, 6))
    return {"instruction": "Sort these words alphabetically.", "input": " ".join(words),
            "output": " ".join(sorted(words))}


def repeat_word(rng: random.Random) -> Record:
    word, times = rng.choice(WORDS), rng.randint(1, 5)
    return {"instruction": f"Repeat the word {times} times.", "input": word,
            "output": " ".join([word] * times)}


def count_words(rng: random.Random) -> Record:
    words = rng.choices(WORDS, k=rng.randint(1, 9))
    return {"instruction": "How many words are in the text?", "input": " ".join(words),
            "output": str(len(words))}


TASKS: tuple[Callable[[random.Random], Record], ...] = (
    reverse_word, add_numbers, uppercase, capital_city, sort_words, repeat_word, count_words,
)


def generate(n_records: int, seed: int) -> list[Record]:
    rng = random.Random(seed)
    return [rng.choice(TASKS)(rng) for _ in range(n_records)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("data/tiny_instruct.jsonl"))
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for record in generate(args.records, args.seed):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.records} records to {args.out}")


if __name__ == "__main__":
    main()
