"""An Ollama Modelfile beside an exported GGUF: FROM the file, a TEMPLATE translated from the model's chat template
where it is a known family's, a SYSTEM where that template has a default system prompt, and PARAMETER stop lines.

A translation is written only when it renders a two-turn chat with a system message exactly as the Hugging Face
template does (and a chat without one, with the default system prompt): a template we only think we recognize is
reported as untranslated rather than written wrong. Ollama's templates here are its plain form ({{ .System }},
{{ .Prompt }}, {{ .Response }}), which Ollama repeats for each turn of a conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ChatFamily:
    name: str
    markers: tuple[str, ...]  # all in the Hugging Face template: this family's turn format
    template: str  # Ollama's plain form
    end_of_turn: str


FAMILIES = (
    ChatFamily("chatml", ("<|im_start|>", "<|im_end|>"),
               "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
               "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n", "<|im_end|>"),
    ChatFamily("llama3", ("<|start_header_id|>", "<|eot_id|>"),
               "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
               "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>", "<|eot_id|>"),
    ChatFamily("gemma", ("<start_of_turn>", "<end_of_turn>"),
               "<start_of_turn>user\n{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}<end_of_turn>\n"
               "<start_of_turn>model\n{{ .Response }}<end_of_turn>\n", "<end_of_turn>"),
    ChatFamily("phi3", ("<|user|>", "<|assistant|>", "<|end|>"),
               "{{ if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}"
               "{{ if .Prompt }}<|user|>\n{{ .Prompt }}<|end|>\n{{ end }}"
               "<|assistant|>\n{{ .Response }}<|end|>\n", "<|end|>"),
)
# a chat to check a translation by: two turns, a system message, text no template would add itself
PROBE = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]


def render(template: str, system: str, prompt: str, response: str | None = None) -> str:
    """Ollama's plain template for one turn, as Ollama fills it; `response` None: cut where the reply begins."""
    values = {"System": system, "Prompt": prompt}
    text = template if response is not None else template.split("{{ .Response }}")[0]
    text = re.sub(r"\{\{ if \.(System|Prompt) \}\}(.*?)\{\{ end \}\}", lambda m: m[2] if values[m[1]] else "",
                  text, flags=re.S)
    return text.replace("{{ .System }}", system).replace("{{ .Prompt }}", prompt).replace(
        "{{ .Response }}", response or "")


def render_chat(template: str, messages: list[dict[str, str]], default_system: str = "") -> str:
    """A conversation as Ollama renders a plain template: each user turn with its reply, the system message in the
    first (the Modelfile's SYSTEM where the chat has none)."""
    system = next((m["content"] for m in messages if m["role"] == "system"), default_system)
    turns = [m for m in messages if m["role"] != "system"]
    text = ""
    for i in range(0, len(turns), 2):
        reply = turns[i + 1]["content"] if i + 1 < len(turns) else None
        text += render(template, system if i == 0 else "", turns[i]["content"], reply)
    return text


def hf_render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The Hugging Face template's text for the chat, less the BOS it writes where the tokenizer adds one itself
    (llama.cpp then adds it too: Ollama's template must not)."""
    text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    adds_bos = bos_id is not None and tokenizer("x").input_ids[:1] == [bos_id]
    return text.removeprefix(bos) if adds_bos and isinstance(bos, str) else text


def default_system(template: str, expected: str, messages: list[dict[str, str]]) -> str | None:
    """The system prompt the template adds to a chat without one ('' for none); None: the shapes do not match."""
    plain = render_chat(template, messages)
    if plain == expected:
        return ""
    prefix, _, suffix = render_chat(template, messages, "\0").partition("\0")
    if expected.startswith(prefix) and expected.endswith(suffix) and len(expected) > len(prefix) + len(suffix):
        return expected[len(prefix):len(expected) - len(suffix)]
    return None


@dataclass
class Translation:
    family: ChatFamily | None
    system: str  # the default system prompt ('' for none)
    note: str  # what was done, in words


def translate(tokenizer: PreTrainedTokenizerBase) -> Translation:
    """The chat template as an Ollama TEMPLATE where it is a known family's and renders the probe chats the same."""
    source = tokenizer.chat_template
    if not isinstance(source, str):
        return Translation(None, "", "the tokenizer has no chat template: no TEMPLATE written")
    for family in FAMILIES:
        if not all(marker in source for marker in family.markers):
            continue
        try:
            with_system, without = hf_render(tokenizer, PROBE), hf_render(tokenizer, PROBE[1:])
        except Exception as err:  # a template that refuses the probe (e.g. no system role) is not translated
            return Translation(None, "", f"the {family.name} template refused a probe chat ({type(err).__name__})")
        system = default_system(family.template, without, PROBE[1:])
        if render_chat(family.template, PROBE) == with_system and system is not None:
            return Translation(family, system, f"TEMPLATE translated from the {family.name} chat template")
        return Translation(None, "", f"the chat template looks like {family.name} but renders chats otherwise: no "
                                     "TEMPLATE written (Ollama falls back to the GGUF's own chat template)")
    return Translation(None, "", "the chat template is not a known family's (chatml, llama3, gemma, phi3): no TEMPLATE "
                                 "written (Ollama falls back to the GGUF's own chat template)")


def stop_tokens(tokenizer: PreTrainedTokenizerBase, folder: Path, family: ChatFamily | None) -> list[str]:
    """The end-of-turn and end-of-sequence tokens generation stops at: the family's, the tokenizer's eos and those of
    generation_config.json."""
    ids: list[Any] = []
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
    names = [family.end_of_turn] if family else []
    names += [tokenizer.eos_token] + [tokenizer.convert_ids_to_tokens(i) for i in ids if isinstance(i, int)]
    vocab = tokenizer.get_vocab()
    return list(dict.fromkeys(name for name in names if isinstance(name, str) and name in vocab))


def quoted(text: str) -> str:
    return '"""' + text + '"""'


def modelfile(gguf_name: str, translation: Translation, stops: list[str], adapter: str | None = None) -> str:
    """FROM the GGUF beside it, or (`adapter`: a LoRA GGUF beside it) FROM the base GGUF `gguf_name` names."""
    lines = [f"FROM ./{gguf_name}", ""] if adapter is None else [f"FROM {gguf_name}", f"ADAPTER ./{adapter}", ""]
    if translation.family is None:
        lines.append(f"# {translation.note}")
    else:
        lines.append(f"TEMPLATE {quoted(translation.family.template)}")
        if translation.system:
            lines.append(f"SYSTEM {quoted(translation.system)}")
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(out_dir: Path, gguf_name: str, tokenizer: PreTrainedTokenizerBase, source: Path,
                    adapter: str | None = None) -> Translation:
    translation = translate(tokenizer)
    stops = stop_tokens(tokenizer, source, translation.family)
    (out_dir / "Modelfile").write_text(modelfile(gguf_name, translation, stops, adapter))
    return translation
