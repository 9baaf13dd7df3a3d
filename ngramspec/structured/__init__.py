"""Structured outputs: grammars (JSON schema, regex, choice, Lark/EBNF) compiled by llguidance,
a per-request matcher that prunes draft trees, drafts the tokens a grammar forces, and masks the
verify rows."""
