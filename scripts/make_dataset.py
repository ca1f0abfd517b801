"""Generate the shipped datasets: simple, learnable tasks (alpaca format) and preference pairs.

`--kind instruct` (tiny_cpu's data/tiny_instruct.jsonl); `--kind prompts` (tiny_cpu_grpo's data/tiny_prompts.jsonl:
a category to name words of, scored by examples/rewards.py); `--kind kto` (data/tiny_kto.jsonl: the same
rule's completions unpaired, each labelled desirable or not); `--kind preferences` (tiny_cpu_dpo's
data/tiny_preferences.jsonl): pairs whose chosen completion follows a rule a tiny model can learn from pairs
alone: it names the right capital (the rejected one another country's), or it copies a text in capital letters
(the rejected one copies it as written), in TRL's conversational shape (prompt, chosen and rejected as message
lists; a JSON Lines file holds one shape: its columns have one type). Seeded: each command reproduces its file byte
for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


Pair = tuple[str, str, str]  # prompt, chosen, rejected


def capital_pair(rng: random.Random) -> Pair:
    country, other = rng.sample(sorted(COUNTRIES), 2)
    answer = f"The capital of {country} is {{}}."
    return f"What is the capital of {country}?", answer.format(COUNTRIES[country]), answer.format(COUNTRIES[other])


def capital_letters_pair(rng: random.Random) -> Pair:
    words = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
    return f"Write the text in capital letters.\n\n{words}", words.upper(), words


def preference_record(pair: Pair) -> dict[str, Any]:
    prompt, chosen, rejected = pair
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def generate_preferences(n_records: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [preference_record(rng.choice((capital_pair, capital_letters_pair))(rng)) for _ in range(n_records)]


def generate_kto(n_records: int, seed: int) -> list[dict[str, Any]]:
    """KTO's unpaired records (TRL's shape: prompt, completion, label): each a pair's chosen completion, labelled
    desirable, or its rejected one, labelled undesirable."""
    rng = random.Random(seed)
    records = []
    for _ in range(n_records):
        prompt, chosen, rejected = rng.choice((capital_pair, capital_letters_pair))(rng)
        desirable = rng.random() < 0.5
        records.append({"prompt": [{"role": "user", "content": prompt}],
                        "completion": [{"role": "assistant", "content": chosen if desirable else rejected}],
                        "label": desirable})
    return records


# GRPO's prompts: a category to name words of; examples/rewards.py scores the share of the completion's words in it
CATEGORIES = {"colors": ("yellow", "purple", "orange", "silver", "copper"),
              "animals": ("tiger", "dragon", "falcon", "rabbit")}


def generate_prompts(n_records: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    asks = ("Name some {}.", "List a few {}.", "Say some {}, please.")
    records = []
    for _ in range(n_records):
        category = rng.choice(sorted(CATEGORIES))
        records.append({"prompt": rng.choice(asks).format(category), "category": category})
    return records


def calculator_schema() -> dict[str, Any]:
    """examples/agent_tools.py's calculate as GRPO shows it (transformers' get_json_schema): the SFT data's tool."""
    from transformers.utils import get_json_schema

    from qlora_fsdp.agents.user_code import load_file

    tools = load_file(Path(__file__).resolve().parent.parent / "examples" / "agent_tools.py")
    return get_json_schema(tools.calculate)


def product_question(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, answer): a product of a two- and a three-digit number, beyond a small model's head."""
    a, b = rng.randint(12, 99), rng.randint(101, 999)
    expression = f"{a} * {b}"
    return rng.choice(("What is {}?", "Compute {}.", "How much is {}?")).format(expression), expression, str(a * b)


def generate_tool_calls(n_records: int, seed: int) -> list[dict[str, Any]]:
    """Conversations that call the calculator for a product and answer with its result (OpenAI's chat shape)."""
    rng, schema = random.Random(seed), calculator_schema()
    records = []
    for _ in range(n_records):
        question, expression, answer = product_question(rng)
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        records.append({"messages": [
            {"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": f"{expression} = {answer}"}],
            "tools": [schema]})
    return records


def generate_tool_prompts(n_records: int, seed: int) -> list[dict[str, Any]]:
    """Products to compute (GRPO with the calculator): `answer` reaches math_answer."""
    rng = random.Random(seed)
    return [dict(zip(("prompt", "answer"), product_question(rng)[::2], strict=True)) for _ in range(n_records)]


# kind -> (generator, default file, default records, default seed)
KINDS: dict[str, tuple[Callable[[int, int], list[Any]], str, int, int]] = {
    "instruct": (generate, "data/tiny_instruct.jsonl", 4000, 1234),
    "preferences": (generate_preferences, "data/tiny_preferences.jsonl", 2000, 4321),
    "prompts": (generate_prompts, "data/tiny_prompts.jsonl", 500, 2468),
    "kto": (generate_kto, "data/tiny_kto.jsonl", 2000, 8642),
    "tool_calls": (generate_tool_calls, "data/tool_calls.jsonl", 400, 1357),
    "tool_prompts": (generate_tool_prompts, "data/tool_prompts.jsonl", 300, 9753),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=sorted(KINDS), default="instruct")
    parser.add_argument("--out", type=Path, help="default: data/tiny_instruct.jsonl or data/tiny_preferences.jsonl")
    parser.add_argument("--records", type=int, help="default: 4000 instruct records, 2000 preference pairs")
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    make, default_out, default_records, default_seed = KINDS[args.kind]
    out, records = args.out or Path(default_out), args.records or default_records
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for record in make(records, default_seed if args.seed is None else args.seed):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {records} records to {out}")


if __name__ == "__main__":
    main()
