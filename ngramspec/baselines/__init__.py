"""Peers re-implemented faithfully, for comparison."""
