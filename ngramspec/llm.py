"""LLM: the offline API. `LLM(model=None, **options).generate(prompts, sampling_params)`, with
vLLM's spellings (`speculative_config`, `sampling_params=`, `chat_template`, `seed`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from ngramspec.config import EngineConfig
from ngramspec.drafting.protocol import Drafter
from ngramspec.engine.engine import LLMEngine
from ngramspec.outputs import RequestOutput, build_group_output
from ngramspec.sampling_params import SamplingParams
from ngramspec.vllm_compat import load_chat_template, merge_speculative_config, seed_everything

# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, record_streams: str | None = None,
                 custom_drafter: Drafter | None = None, *,
                 speculative_config: dict[str, Any] | str | None = None,
                 chat_template: str | None = None, seed: int | None = None,
                 **options: Any) -> None:
        """`model`: a GGUF file, an HF directory or an HF id in the local HF cache.
        `options`: EngineConfig fields (`drafter` is a DrafterConfig) and DrafterConfig fields.
        `speculative_config`: vLLM's (see vllm_compat.SPECULATIVE_CONFIG_HELP); an error where
        it contradicts `options`. `chat_template`: Jinja text or a file replacing the model's.
        `seed`: seeds the generators that requests without a seed of their own draw from.
        `custom_drafter`: any object with the Drafter protocol, used instead of the configured
        one (needs speculative="ngram")."""
        if speculative_config is not None:
            options = merge_speculative_config(options, speculative_config)
        template = load_chat_template(chat_template)
        self.config = EngineConfig.from_kwargs(model=model, **options)
        if seed is not None:
            seed_everything(seed)
        self.record_streams = record_streams
        self.engine = LLMEngine(self.config, drafter=custom_drafter)
        self.tokenizer = self.engine.tokenizer
        if template is not None:  # on the tokenizer, so every apply_chat_template uses it
            self.tokenizer.chat_template = template
        self._next_id = 0

    def generate(
        self, prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False, on_tokens: Callable[[str, list[int]], None] | None = None,
        references: Seq[list[str]] | None = None, *,
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `on_tokens(request_id, new_ids)` sees tokens as they come.
        `params` is the older name of `sampling_params` (vLLM's)."""
        sampling_params = _one_of(sampling_params, params)
        prompt_list = [prompts] if _is_single(prompts) else list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list))
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
                refs = None if references is None else [self.encode(r) for r in references[i]]
                ids.append(self.add_request(prompt, p, refs))
        except Exception:
            # One bad prompt rejects the whole call; the ones already queued must not linger.
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm, on_tokens)

    def chat(
        self, messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False, *, params: SamplingParams | Seq[SamplingParams] | None = None,
        chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation or several. `chat_template` (Jinja text) replaces the model's for
        this call; `chat_template_kwargs` are extra template variables (both vLLM's)."""
        sampling_params = _one_of(sampling_params, params)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, chat_template, **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, **kwargs)

    def apply_chat_template(self, messages: list[Message], chat_template: str | None = None,
                            **template_kwargs: Any) -> list[int]:
        """The prompt ids of a conversation, ready for the assistant's turn."""
        if chat_template is not None:
            template_kwargs["chat_template"] = chat_template
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, **template_kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def update_weights(self, source: str | dict[str, Any]) -> None:
        """New weights in place (a model path or an HF-named state dict); see
        LLMEngine.update_weights for what happens to requests in flight and to the caches."""
        self.engine.update_weights(source)

    def close(self) -> None:
        """Stop the engine's tensor-parallel follower processes, if any."""
        self.engine.close()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, prompt: Prompt, params: SamplingParams,
                    references: list[list[int]] | None = None) -> str:
        prompt = _unwrap_prompt(prompt)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = f"req-{self._next_id}"
        self._next_id += 1
        self.engine.add_request(request_id, ids, params, references)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool, on_tokens) -> list[RequestOutput]:
        """`on_tokens` sees each choice under its own id (choice i > 0: "<request id>/i")."""
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if on_tokens is not None and out.new_token_ids:
                    on_tokens(out.seq.request_id, out.new_token_ids)
                first = out.seq.choices[0] if out.seq.choices else out.seq
                if out.seq.is_finished and all(s.is_finished for s in first.choices or [first]):
                    done[first.request_id] = build_group_output(first, self.tokenizer)
                    bar.update(1)
        bar.close()
        outputs = [done[r] for r in request_ids]
        if self.record_streams:
            self._record(outputs)
        return outputs

    def _record(self, outputs: list[RequestOutput]) -> None:
        """Greedy streams for the replay simulator (`ngramspec simulate`)."""
        with open(self.record_streams, "a") as f:
            for out in outputs:
                line = {"id": out.request_id, "prompt_ids": out.prompt_token_ids,
                        "output_ids": out.token_ids}
                f.write(json.dumps(line) + "\n")


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, (str, dict)) or (bool(prompts) and isinstance(prompts[0], int))


def _unwrap_prompt(prompt: Prompt) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt dicts as text or ids."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) & {"prompt", "prompt_token_ids"}
    if len(keys) != 1 or set(prompt) - keys:
        raise ValueError("a dict prompt takes exactly one of 'prompt' (text) or "
                         f"'prompt_token_ids' (ids), got keys {sorted(prompt)}")
    return prompt[keys.pop()]


def _one_of(sampling_params: Any, params: Any) -> Any:
    if sampling_params is not None and params is not None:
        raise TypeError("give sampling_params or params (its older name), not both")
    return params if sampling_params is None else sampling_params


def _broadcast(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
