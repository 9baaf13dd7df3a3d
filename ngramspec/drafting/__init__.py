"""The n-gram drafter: protocol, config, trees, sources, calibration and the compiled drafter.

Imports no torch and nothing from engine/, server/ or models/.
"""
