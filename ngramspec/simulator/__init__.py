"""Exact replay of greedy speculative decoding on recorded token streams.

Imports no torch and nothing from engine/, server/ or models/.
"""
