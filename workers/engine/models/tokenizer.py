"""The tokenizer of a local HF folder, with its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

Message = dict[str, str]


class ChatTokenizer:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hf = PreTrainedTokenizerFast.from_pretrained(str(self.folder))
        if self.hf.chat_template is None:
            raise ValueError(f"tokenizer in {self.folder} has no chat template")
        self.eos_token_ids = self._eos_token_ids()
        pad = self.hf.pad_token_id
        self.pad_id: int = pad if pad is not None else self.eos_token_ids[0]
        self.turn_end_text = self._turn_end_text()

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        for name in ("generation_config.json", "config.json"):
            path = self.folder / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                for token_id in eos if isinstance(eos, list) else [eos]:
                    if token_id is not None and token_id not in ids:
                        ids.append(int(token_id))
        if not ids:
            raise ValueError(f"tokenizer in {self.folder} defines no end-of-sequence token")
        return ids

    def _turn_end_text(self) -> str:
        """What the chat template writes after an assistant's reply, as text a decoded reply keeps (special tokens
        dropped): "" for templates that end turns with a special token, "<|end|>" for one that spells it out."""
        marker = "\u2063reply\u2063"
        rendered = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                               add_generation_prompt=False)
        after = rendered[rendered.find(marker) + len(marker):] if marker in rendered else ""
        return self.decode(self.encode(after)).strip()

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_reply(self, ids: list[int]) -> str:
        """A generated reply as text, without the template's end of turn (what a reward and a reader should see)."""
        text = self.decode(ids)
        if self.turn_end_text and text.rstrip().endswith(self.turn_end_text):
            return text.rstrip()[: -len(self.turn_end_text)]
        return text

    def render(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation that ends where the assistant should start answering."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode_exchange(self, messages: list[Message], response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) for supervised training on the assistant's reply only.

        The response ids run to the end of the rendered conversation, so they include the
        template's end of turn; when that holds no end-of-sequence token (a template that ends
        turns with ordinary text), the EOS follows it. Either way the model learns to stop
        where the sampler stops.
        """
        prompt_text = self.render(messages, add_generation_prompt=True)
        full_text = self.render([*messages, {"role": "assistant", "content": response}], add_generation_prompt=False)
        if not full_text.startswith(prompt_text):
            raise ValueError("chat template does not render the prompt as a prefix of the full conversation")
        prompt_ids = self.encode(prompt_text)
        response_ids = self.encode(full_text[len(prompt_text):])
        if not set(response_ids) & set(self.eos_token_ids):
            response_ids.append(self.eos_token_ids[0])
        return prompt_ids, response_ids
