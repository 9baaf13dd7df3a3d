"""The indexes drafts come from: the global trie, the per-request context index, suffix automata."""
