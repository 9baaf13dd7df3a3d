"""Pure-Python reference drafter (the oracle the compiled one is tested against)."""
