"""LLMEngine: add requests, then step() until done.

One step: schedule -> propose -> reserve -> run -> verify -> commit -> observe. The scheduler
owns every KV slot (it allocates, commits, trims and frees them); the speculator drafts and
learns; the runner computes logits; this class sequences the stages and keeps the timings.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ngramspec.config import EngineConfig
from ngramspec.drafting.config import CorpusSnapshot
from ngramspec.drafting.protocol import Drafter
from ngramspec.drafting.tree import DraftTree
from ngramspec.engine.cuda_graphs import GraphLimits
from ngramspec.engine.kv_cache import SlotAllocator
from ngramspec.engine.logprobs import TokenLogprob, prompt_logprobs, step_logprobs
from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.engine.parallel import TensorParallelRunner
from ngramspec.engine.scheduler import Schedule, ScheduledChunk, Scheduler
from ngramspec.engine.sequence import Sequence
from ngramspec.engine.speculator import Speculator
from ngramspec.engine.stats import EngineStats
from ngramspec.engine.stops import check_stop
from ngramspec.engine.verify import VerifyResult, verify_greedy, verify_sampled
from ngramspec.kernels import kernels_available
from ngramspec.layers.attention import KVCache
from ngramspec.layers.sampler import argmax_rows
from ngramspec.models.loader import (
    gguf_file,
    load_gguf_weights,
    load_model_config,
    load_state_dict,
    load_tokenizer,
    resolve_model_dir,
)
from ngramspec.sampling_params import SamplingParams, choice_params, resolve_for_model
from ngramspec.structured.grammar import GrammarCompiler
from ngramspec.structured.matcher import GrammarViolation, RequestGrammar, apply_bitmask

_log = logging.getLogger(__name__)
DRAFTER_LOG_EVERY = 1000  # a failing drafter is logged on its 1st, 1001st, ... failure


@dataclass(slots=True)
class StepOutput:
    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asks


class LLMEngine:
    def __init__(self, config: EngineConfig, corpora: CorpusSnapshot | None = None,
                 drafter: Drafter | None = None) -> None:
        """`corpora`: external corpora the n-gram drafter reads (ignored without speculation);
        `drafter`: use this drafter instead of the one config.drafter describes."""
        if config.quantization == "auto" and config.uses_gguf_kernels and not kernels_available():
            config = dataclasses.replace(config, quantization="none")  # no compiler: dense fp32
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model_dir(config.model)
        self.model_cfg = load_model_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = min(config.max_model_len, self.model_cfg.max_position_embeddings)
        dtype, device = config.torch_dtype, config.torch_device
        per_slot = KVCache.bytes_per_slot(self.model_cfg.num_layers, self.model_cfg.num_kv_heads,
                                          self.model_cfg.head_dim, config.torch_kv_dtype)
        num_slots = max(2, _kv_cache_bytes(config, device, per_slot, self.max_model_len)
                        // per_slot)
        if config.tensor_parallel_size > 1:
            self.runner = TensorParallelRunner(config, num_slots, self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_cfg, load_state_dict(model_dir), num_slots,
                                      self.max_model_len, dtype, device,
                                      self._gguf_weights(config), config.torch_kv_dtype,
                                      attention_backend=config.attention_backend,
                                      graphs=self._graph_limits(config, device),
                                      gguf_int8=config.gguf_int8)
        self.scheduler = Scheduler(num_slots, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefix_cache=config.enable_prefix_caching)
        # A sequence longer than the whole cache could never be rescheduled (it would wait forever),
        # so it must end with "length" before it gets there.
        self.max_model_len = min(self.max_model_len, self.allocator.num_usable)
        self.eos_token_ids = self._eos_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.model_cfg.vocab_size,
                                        self.eos_token_ids)
        self.stats = EngineStats()
        self.speculator = self._make_speculator(config, corpora, drafter)
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._deferred: list[list[Sequence]] = []  # n > 1 choices waiting for choice 0's prompt
        # The model, tokenizer and drafter leave ~400k long-lived Python objects; a full cyclic
        # collection over them takes ~180 ms here and would land inside some decode step. Freeze
        # them out of the collector (as vLLM does after start-up); later garbage is still collected.
        gc.collect()
        gc.freeze()

    def _graph_limits(self, config: EngineConfig, device: torch.device) -> GraphLimits | None:
        if device.type != "cuda" or config.enforce_eager:
            return None
        return GraphLimits.for_engine(config.max_num_batched_tokens, config.max_num_seqs,
                                      self.max_model_len)

    def _gguf_weights(self, config: EngineConfig) -> dict | None:
        if not config.uses_gguf_kernels:
            return None
        path = gguf_file(config.model)
        if path is None:
            raise ValueError(f"quantization='gguf' needs a .gguf model file, not {config.model!r}")
        return load_gguf_weights(path, self.model_cfg.num_heads, self.model_cfg.num_kv_heads)

    @property
    def allocator(self) -> SlotAllocator:
        """The KV slot counts (num_free, num_usable); only the scheduler allocates and frees."""
        return self.scheduler.allocator

    def _make_speculator(self, config: EngineConfig, corpora: CorpusSnapshot | None,
                         drafter: Drafter | None) -> Speculator | None:
        if config.speculative != "ngram":
            if drafter is not None:
                raise ValueError("a drafter was given but speculation is off; "
                                 "set speculative='ngram'")
            return None
        from ngramspec.drafting.factory import make_drafter
        from ngramspec.engine.cost_model import measure_cost
        from ngramspec.policy.cost import VerifyCost

        cost = None
        if config.sizes_drafts:
            cost = (VerifyCost.from_relative(config.verify_cost) if config.verify_cost is not None
                    else measure_cost(self.runner, self.scheduler, self.max_model_len,
                                      max_tokens=min(128, config.max_num_batched_tokens)))
        return Speculator(config.drafter, drafter or make_drafter(config.drafter, corpora), cost,
                          learn_step_times=config.verify_cost is None)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    references: list[list[int]] | None = None) -> Sequence:
        """Queue a request; returns its sequence (for n > 1, choice 0: every choice is in
        `.choices`, choice i under the id `choice_id(request_id, i)`)."""
        params = resolve_for_model(params, self.eos_token_ids, self._encode_words)
        if params.n == 1:
            self._validate(request_id, prompt_ids, params)
            return self._add_sequence(request_id, prompt_ids, params, references)
        ids = [choice_id(request_id, i) for i in range(params.n)]
        for rid in ids:
            self._validate(rid, prompt_ids, params)
        choices = [self._add_sequence(rid, prompt_ids, choice_params(params, i), references,
                                      queue=i == 0) for i, rid in enumerate(ids)]
        for seq in choices:
            seq.choices = choices
        if self.scheduler.cache is None:
            for seq in choices[1:]:
                self.scheduler.add(seq)
        else:  # the other choices start once choice 0's prompt is cached
            self._deferred.append(choices)
        return choices[0]

    def _add_deferred(self) -> None:
        """Queue the other choices of requests whose choice 0 has its prompt cached (or ended):
        they reuse its K/V and compute only the prompt's last token."""
        waiting = []
        for choices in self._deferred:
            first = choices[0]
            if first.num_cached >= first.num_prompt_tokens or first.is_finished:
                for seq in choices[1:]:
                    if not seq.is_finished:  # aborted meanwhile
                        self.scheduler.add(seq)
            else:
                waiting.append(choices)
        self._deferred = waiting

    def _add_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      references: list[list[int]] | None, queue: bool = True) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(next(self._ids), request_id, list(prompt_ids), len(prompt_ids), params,
                       self.eos_token_ids, generator=generator)
        if params.structured_outputs is not None:  # GrammarError (a ValueError) names the problem
            seq.grammar = RequestGrammar(self.grammars.matcher(params.structured_outputs),
                                         self.model_cfg.vocab_size, self.eos_token_ids)
        seq.use_spec = self.speculator is not None and params.speculative
        if self.speculator is not None:
            self.speculator.start(seq, references)
        self._seqs[request_id] = seq
        if queue:
            self.scheduler.add(seq)
        return seq

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if bad := sorted({t for t in ids if t >= vocab}):
                raise ValueError(f"{name}: token ids {bad} are outside the vocabulary "
                                 f"[0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the context holds "
                             f"{self.max_model_len} (prompt + at least one new token)")
        if len(prompt_ids) + 1 + self.scheduler.admission_reserve > self.allocator.num_usable:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the KV cache holds "
                             f"only {self.allocator.num_usable}; raise kv_cache_bytes")

    def _encode_words(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def abort_request(self, request_id: str) -> None:
        """End a request (for n > 1, the request's id ends every choice; a choice's own id,
        that choice)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        for target in seq.choices if seq.choices and seq.choices[0] is seq else [seq]:
            self._seqs.pop(target.request_id, None)
            if not target.is_finished:
                target.finish_reason = "abort"
                self._finish(target)

    def update_weights(self, source: str | os.PathLike | dict[str, torch.Tensor]) -> None:
        """Load new weights in place, between steps: a model path (GGUF file or HF directory) or
        an HF-named state dict, same architecture and shapes.

        Requests in flight are not lost: each keeps its tokens, its K/V is recomputed under the
        new weights, and it continues with them (so its text so far came from the old ones).
        The prefix cache is emptied; the learned n-gram corpus is kept (it is model-free) and
        the acceptance calibration restarts. A GGUF path under GGUF kernels keeps running on
        its blocks; a state dict replaces them with dense weights.
        """
        if isinstance(source, dict):
            state, gguf = source, None
        else:
            model_dir = resolve_model_dir(str(source))
            if load_model_config(model_dir) != self.model_cfg:
                raise ValueError(f"{source} is not the same architecture as the loaded model")
            state = load_state_dict(model_dir)
            gguf = self._gguf_weights(dataclasses.replace(self.config, model=str(source))) \
                if self.config.uses_gguf_kernels else None
        self.runner.load_weights(state, gguf)  # raises before changing anything
        self.scheduler.recompute_all()
        self.scheduler.flush_cache()
        if self.speculator is not None:
            self.speculator.restart_calibration()

    def close(self) -> None:
        """Stop the tensor-parallel follower processes, if any (idempotent)."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or any(
            not seq.is_finished for choices in self._deferred for seq in choices[1:])

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        if self._deferred:
            self._add_deferred()
        schedule = self.scheduler.schedule()
        if not schedule:
            return []
        try:
            trees = self._propose(schedule)
            masks = self._grammar_masks(schedule, trees)
            t1 = time.perf_counter()
            items = [self._forward_item(c, trees.get(c.seq.seq_id)) for c in schedule.chunks]
            logits = self.runner.run(items)  # [rows, vocab]
            t2 = time.perf_counter()
            if self.speculator is not None and self.runner.asynchronous:
                self._overlap()  # the accelerator is still computing `logits`
                self.stats.overlapped_draft_time += time.perf_counter() - t2
        except Exception:
            self._fail(schedule)
            raise
        outputs = self._postprocess(schedule, trees, logits, masks)
        if self.speculator is not None:
            self.speculator.after_step(schedule, time.perf_counter() - t0)
        self.stats.add_step(t1 - t0, t2 - t1, time.perf_counter() - t0)
        self.stats.device_time += self.runner.take_device_seconds()
        self.stats.num_prefill_tokens += sum(c.num_tokens for c in schedule.prefills)
        return outputs

    def _propose(self, schedule: Schedule) -> dict[int, DraftTree]:
        """Draft trees for this step's decodes, each with its slots reserved (or dropped)."""
        if self.speculator is None:
            return {}
        by_seq = {c.seq.seq_id: c for c in schedule.decodes}
        reserve = self.scheduler.reserve_tree
        try:
            proposed = self.speculator.propose(schedule)
        except Exception as exc:  # any drafter bug: this step decodes plainly
            self._drafter_failed(exc)
            return {}
        return {seq_id: tree for seq_id, tree in proposed.items()
                if not tree.num_drafts or reserve(by_seq[seq_id], tree.num_drafts)}

    def _overlap(self) -> None:
        assert self.speculator is not None
        try:
            self.speculator.overlap()
        except Exception as exc:  # any drafter bug: the next propose starts from what is left
            self._drafter_failed(exc)

    def _drafter_failed(self, exc: Exception) -> None:
        """Drafts only save steps: a step without them is plain decoding, which is always right,
        so a failing drafter costs speed, never a request. Logged with its traceback the first
        time, then once in DRAFTER_LOG_EVERY failures."""
        self.stats.draft_failures += 1
        if self.stats.draft_failures % DRAFTER_LOG_EVERY == 1:
            _log.warning("the drafter failed (%d so far); this step decodes without drafts",
                         self.stats.draft_failures, exc_info=exc)

    def _fail(self, schedule: Schedule) -> None:
        """A step that failed before committing: free its slots, end its requests, keep serving."""
        for chunk in schedule.chunks:
            self._fail_chunk(chunk)

    def _fail_chunk(self, chunk: ScheduledChunk) -> None:
        """Free a chunk's uncommitted slots and end its request with "error"."""
        self.scheduler.release(chunk)
        if not chunk.seq.is_finished:
            chunk.seq.finish_reason = "error"
            self._finish(chunk.seq)

    def _forward_item(self, chunk: ScheduledChunk, tree: DraftTree | None) -> ForwardItem:
        seq, start = chunk.seq, chunk.start
        if tree is not None and tree.num_drafts:
            return ForwardItem(tree.token_ids, tree.positions(start), seq.slots, chunk.slots,
                               None, list(range(len(tree))), parents=tree.parents)
        end = start + chunk.num_tokens
        # rows for prompt logprobs (each predicts the next prompt token), then the sampling row
        rows = list(range(_prompt_rows(chunk))) + ([chunk.num_tokens - 1] if chunk.samples else [])
        return ForwardItem(seq.token_ids[start:end], list(range(start, end)), seq.slots,
                           chunk.slots, None, rows)

    def _postprocess(self, schedule: Schedule, trees: dict[int, DraftTree], logits: torch.Tensor,
                     masks: dict[int, torch.Tensor | Exception]) -> list[StepOutput]:
        """Verify, commit and observe every chunk that yields a token; commit the others."""
        # logits: [rows, vocab]; each chunk's prompt-logprob rows, then its tree's rows
        spans, row = {}, 0
        for chunk in schedule.chunks:
            row += _prompt_rows(chunk)
            if chunk.samples:
                tree = _verified_tree(chunk, trees)
                spans[chunk.seq.seq_id] = (row, tree)
                row += len(tree)
        failed = self._apply_grammars(spans, masks, logits)
        greedy_targets = self._greedy_targets([c for c in schedule.chunks if c.samples], logits)
        outputs, row = [], 0
        for chunk in schedule.chunks:
            seq = chunk.seq
            if n := _prompt_rows(chunk):
                self._record_prompt_logprobs(chunk, logits[row : row + n])
                row += n
            if not chunk.samples:
                self.scheduler.commit(chunk)
                continue
            first, tree = spans[seq.seq_id]
            row = first + len(tree)
            try:
                if seq.seq_id in failed:
                    raise failed[seq.seq_id]
                result = self._verify(seq, tree, logits, greedy_targets, first)
            except (RuntimeError, GrammarViolation):
                # e.g. non-finite logits or a failed grammar: end this request, not the engine
                self._fail_chunk(chunk)
                outputs.append(StepOutput(seq))
                continue
            self.scheduler.commit(chunk, [0] + result.accepted_nodes if tree.num_drafts else None)
            outputs.append(self._append(seq, tree, result, logits, first))
        return outputs

    def _grammar_masks(self, schedule: Schedule, trees: dict[int, DraftTree]
                       ) -> dict[int, torch.Tensor | Exception]:
        """seq_id -> the allowed-token bitmask after every node of its tree (the root alone for
        a prefill's sampling row), or the GrammarViolation that ended its grammar. Computed
        before the forward pass, while the matcher's tables are still in cache from drafting."""
        masks: dict[int, torch.Tensor | Exception] = {}
        t0 = time.perf_counter()
        for chunk in schedule.chunks:
            seq = chunk.seq
            if seq.grammar is None or not chunk.samples:
                continue
            try:
                masks[seq.seq_id] = seq.grammar.bitmasks(_verified_tree(chunk, trees))
            except GrammarViolation as e:
                masks[seq.seq_id] = e
        self.stats.grammar_mask_time += time.perf_counter() - t0
        return masks

    def _apply_grammars(self, spans: dict[int, tuple[int, DraftTree]],
                        masks: dict[int, torch.Tensor | Exception],
                        logits: torch.Tensor) -> dict[int, Exception]:
        """Mask every grammar-constrained row in place; returns the sequences whose grammar
        failed."""
        failed: dict[int, Exception] = {}
        t0 = time.perf_counter()
        for seq_id, mask in masks.items():
            if isinstance(mask, Exception):
                failed[seq_id] = mask
                continue
            first, tree = spans[seq_id]
            with torch.inference_mode():  # logits come from the runner's inference mode
                apply_bitmask(logits[first : first + len(tree)], mask, self.eos_token_ids)
            self.stats.grammar_mask_rows += len(tree)
        self.stats.grammar_mask_time += time.perf_counter() - t0
        return failed

    @staticmethod
    def _record_prompt_logprobs(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after this chunk's positions (once: a recompute after
        preemption finds them recorded)."""
        seq, first = chunk.seq, chunk.start + 1  # the token row 0 predicts
        done = 1 + len(seq.prompt_logprobs)  # prompt tokens already covered (token 0 has none)
        next_ids = seq.token_ids[first : first + logits.shape[0]]
        skip = max(0, done - first)
        if skip < len(next_ids):
            seq.prompt_logprobs.extend(prompt_logprobs(logits[skip:], next_ids[skip:],
                                                       seq.params.prompt_logprobs or 0))

    def _greedy_targets(self, chunks: list[ScheduledChunk],
                        logits: torch.Tensor) -> list[int] | None:
        # One argmax for the whole batch when no request needs per-row processing.
        if all(c.seq.params.greedy and not c.seq.params.processes_logits for c in chunks):
            return argmax_rows(logits)
        return None

    def _verify(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor,
                greedy_targets: list[int] | None, row: int) -> VerifyResult:
        """The tree's rows are logits[row : row + len(tree)], sliced only where read: a tensor
        slice costs a few µs of dispatch, twice per request-step at batch 64."""
        if greedy_targets is not None:
            return verify_greedy(tree, greedy_targets[row : row + len(tree)])
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        return verify_sampled(tree, logits[row : row + len(tree)], seq.params, prompt,
                              seq.output_ids, seq.generator)

    def _append(self, seq: Sequence, tree: DraftTree, result: VerifyResult,
                logits: torch.Tensor, row: int) -> StepOutput:
        """Append the verified tokens up to the first stop, then observe and trim."""
        # logits: [rows, vocab]; this sequence's tree is rows row : row + len(tree)
        out = StepOutput(seq)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if seq.params.logprobs is not None:
            out.new_logprobs = step_logprobs(logits[row : row + len(tree)],
                                             [0] + result.accepted_nodes, result.output_ids,
                                             seq.params, seq.token_ids[: seq.num_prompt_tokens],
                                             seq.output_ids)
        for token in result.output_ids:
            seq.token_ids.append(token)
            out.new_token_ids.append(token)
            reason = check_stop(seq, self.tokenizer, self.max_model_len)
            if seq.grammar is not None and reason != "stop":
                reason = self._advance_grammar(seq, token) or reason
            if reason is not None:
                seq.finish_reason = reason
                break
        del out.new_logprobs[len(out.new_token_ids):]  # none for tokens after a stop
        seq.logprobs.extend(out.new_logprobs)
        if self.speculator is not None:
            counters = self.speculator.observe(seq, tree, result, out.new_token_ids)
            if counters is not None:
                seq.spec.add(counters)
                self.stats.add(counters)
        self.scheduler.trim(seq)
        if seq.finish_reason is not None:
            self._finish(seq)
        return out

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> str | None:
        """"stop" once the grammar is complete (plain decoding stops there too)."""
        assert seq.grammar is not None
        try:
            return seq.grammar.advance(token)
        except GrammarViolation:
            return "error"

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, reusable=seq.finish_reason != "error")
        if self.speculator is not None:
            self.speculator.stop(seq)
        self._seqs.pop(seq.request_id, None)


def _kv_cache_bytes(config: EngineConfig, device: torch.device, per_slot: int,
                    max_model_len: int) -> int:
    """EngineConfig.kv_cache_bytes, with None resolved for this device."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return 1 << 30
    # the budget covers all ranks (each holds its share of the K/V heads); at most 30% of the
    # GPU, and half of what is free now (the weights and CUDA graphs come after)
    wanted = (config.max_num_seqs * max_model_len + 1) * per_slot
    free, total = torch.cuda.mem_get_info(device)
    limit = min(0.3 * total, 0.5 * free) * config.tensor_parallel_size
    return max(1 << 30, min(wanted, int(limit)))


def _verified_tree(chunk: ScheduledChunk, trees: dict[int, DraftTree]) -> DraftTree:
    """The rows a sampling chunk verifies: its draft tree, or its last token alone."""
    return trees.get(chunk.seq.seq_id) or DraftTree.root_only(chunk.seq.token_ids[-1])


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of an n > 1 request (choice 0 keeps the request's)."""
    return request_id if index == 0 else f"{request_id}/{index}"


def _prompt_rows(chunk: ScheduledChunk) -> int:
    """Rows of this chunk whose logits give prompt-token logprobs (0 unless the request asks):
    every position before the prompt's last token."""
    seq = chunk.seq
    if seq.params.prompt_logprobs is None or chunk.start >= seq.num_prompt_tokens - 1:
        return 0
    return min(chunk.num_tokens, seq.num_prompt_tokens - 1 - chunk.start)
