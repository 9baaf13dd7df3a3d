"""LLM: the offline API. `LLM(model=None, **options).generate(prompts, params)`."""

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

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, record_streams: str | None = None,
                 custom_drafter: Drafter | None = None, **options: Any) -> None:
        """`options`: EngineConfig fields (`drafter` is a DrafterConfig) and DrafterConfig fields.
        `custom_drafter`: any object with the Drafter protocol, used instead of the configured
        one (needs speculative="ngram")."""
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.record_streams = record_streams
        self.engine = LLMEngine(self.config, drafter=custom_drafter)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False, on_tokens: Callable[[str, list[int]], None] | None = None,
        references: Seq[list[str]] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `on_tokens(request_id, new_ids)` sees tokens as they come."""
        prompt_list = [prompts] if _is_single(prompts) else list(prompts)
        params_list = _broadcast(params or SamplingParams(), len(prompt_list))
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
        params: SamplingParams | Seq[SamplingParams] | None = None, **kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, **kwargs)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))


def _broadcast(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
