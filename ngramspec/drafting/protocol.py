"""The drafter lifecycle shared by the engine and the replay simulator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ngramspec.drafting.tree import DraftTree


class Drafter(Protocol):
    def start(
        self, request_id: str, prompt_ids: list[int], references: list[list[int]] | None = None
    ) -> None:
        """Begin a request. `references` are per-request documents it may copy from."""

    def propose(self, request_ids: list[str], budgets: list[int]) -> Sequence[DraftTree]:
        """One tree per request; `budgets[i]` caps its number of draft nodes (root excluded).
        A list, or a DraftBatch (the trees as arrays, which the engine sizes without reading
        every tree into Python)."""

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        """Tokens appended to the request (accepted drafts + the bonus, or a plain decode)."""

    def stop(self, request_id: str) -> None:
        """The request left; forget its per-request state (its tokens stay in the corpus)."""

    def reset(self) -> None:
        """Forget everything learned online (external corpora are kept)."""

    # Optional: flush() -> None, learning queued by start/commit done now rather than in the next
    # propose (Speculator.overlap calls it while the accelerator runs a step, where present).
